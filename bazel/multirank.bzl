"""multirank_test: runs a test binary as real processes under mpirun or dtrain-launch."""

def multirank_test(name, binary, mode, np, env = {}, size = "medium", tags = []):
    """One sh_test: `mode` is "mpi" (mpirun, backend mpi) or "launch" (dtrain-launch, gloo)."""
    native.sh_test(
        name = name,
        srcs = ["//tests:run_ranks.sh"],
        args = [
            mode,
            str(np),
            "$(location //launcher:dtrain-launch)",
            "$(location %s)" % binary,
        ],
        data = [binary, "//launcher:dtrain-launch"],
        env = env,
        size = size,
        tags = tags + ["multirank"],
    )
