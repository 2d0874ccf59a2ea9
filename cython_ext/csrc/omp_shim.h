/* OpenMP shim: the extension builds with or without OpenMP (setup.py tries
 * -fopenmp first). Without it Cython's prange runs serially and these stubs
 * stand in for the runtime calls the extension makes. */
#ifndef CYLLM_OMP_SHIM_H
#define CYLLM_OMP_SHIM_H
#ifdef _OPENMP
#include <omp.h>
#define CYLLM_OPENMP 1
#else
#define CYLLM_OPENMP 0
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#endif
