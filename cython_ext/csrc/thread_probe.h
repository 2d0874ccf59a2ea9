/* cyllm_probe_threads (thread_probe.c): of n threads counting the caller, how many the
 * system let run at once (n when all did). */
#ifndef CYLLM_THREAD_PROBE_H
#define CYLLM_THREAD_PROBE_H
int cyllm_probe_threads(int n);
#endif
