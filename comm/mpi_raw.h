// Raw MPI handles behind the mpi backend, for benchmarks that call MPI directly on the same
// bytes (bench/comm_bench.cc). Use them only inside run_on_mpi_thread(): the MPI worker
// thread owns every MPI call of the process.
#pragma once

#include <c10/core/ScalarType.h>
#include <mpi.h>

#include "comm/types.h"

namespace dtrain::comm {

// The MPI datatype dtrain sends `dtype` as (fp16/bf16: 2-byte types).
MPI_Datatype mpi_datatype(c10::ScalarType dtype);
// The MPI op dtrain reduces `dtype` with (fp16/bf16: fp32-accumulating user ops).
MPI_Op mpi_op(c10::ScalarType dtype, ReduceOp op);

}  // namespace dtrain::comm
