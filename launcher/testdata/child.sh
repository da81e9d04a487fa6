#!/bin/sh
# A rank for launcher_test: behaves as $1 says; $2 is a scratch folder.
mode=$1
dir=$2
case "$mode" in
  fail)  # rank 1 fails with 3; the others ignore SIGTERM (the launcher must SIGKILL them)
    echo $$ > "$dir/pid.$RANK"
    if [ "$RANK" = 1 ]; then sleep 0.3; exit 3; fi
    trap '' TERM
    sleep 1000 &
    echo $! > "$dir/child.$RANK"
    while true; do wait; done
    ;;
  sleep)  # every rank sleeps until signalled
    echo $$ > "$dir/pid.$RANK"
    sleep 1000 &
    echo $! > "$dir/child.$RANK"
    wait
    ;;
  ignore-term)  # every rank starts a child that ignores SIGTERM, then sleeps
    echo $$ > "$dir/pid.$RANK"
    (trap '' TERM; exec sleep 1000) &
    echo $! > "$dir/child.$RANK"
    wait
    ;;
  count)  # every rank records its restart count; rank 0 fails once all have recorded
    echo "$TORCHELASTIC_RESTART_COUNT" >> "$dir/count.$RANK"
    if [ "$RANK" != 0 ]; then exec sleep 1000; fi
    want=$((TORCHELASTIC_RESTART_COUNT + 1))
    for r in $(seq 0 $((WORLD_SIZE - 1))); do
      while [ "$(cat "$dir/count.$r" 2>/dev/null | wc -l)" -lt "$want" ]; do sleep 0.02; done
    done
    exit 1
    ;;
  env)  # prints its variables, a stderr line, and a last line without newline
    echo "RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT RESTART=$TORCHELASTIC_RESTART_COUNT BACKEND=$DTRAIN_BACKEND OMP=$OMP_NUM_THREADS"
    echo "to stderr" >&2
    printf "partial"
    exit 0
    ;;
esac
