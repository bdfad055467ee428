/* The Open MPI side of bench/compare_launch.py: MPI_Init, one barrier, print the time. */
#include <mpi.h>
#include <stdio.h>
#include <sys/time.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Barrier(MPI_COMM_WORLD);
  struct timeval tv;
  gettimeofday(&tv, NULL);
  printf("PAST_BARRIER %.6f\n", tv.tv_sec + tv.tv_usec / 1e6);
  fflush(stdout);
  MPI_Finalize();
  return 0;
}
