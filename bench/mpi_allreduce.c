/* The Open MPI peer for bench/compare_allreduce.py: the same sweep as `lockstep bench
 * allreduce` (f32 sum, warm-up, slowest rank's mean time), one JSON object per size on rank 0. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  size_t min_bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : 4096;
  size_t max_bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)256 << 20;
  float* send = malloc(max_bytes);
  float* recv = malloc(max_bytes);
  for (size_t i = 0; i < max_bytes / 4; ++i) send[i] = (float)((rank + 1) % 7);
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    int count = (int)(bytes / 4);
    size_t iters = ((size_t)512 << 20) / bytes;
    if (iters < 5) iters = 5;
    if (iters > 2000) iters = 2000;
    for (int i = 0; i < 5; ++i) MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (size_t i = 0; i < iters; ++i) MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double t = (MPI_Wtime() - start) / (double)iters, worst;
    MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) printf("{\"bytes\": %zu, \"time_us\": %.3f, \"iters\": %zu}\n", bytes, worst * 1e6, iters);
    fflush(stdout);
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
