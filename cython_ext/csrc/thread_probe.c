/* How many threads the system lets this process run at once, asked before OpenMP is.
 *
 * libgomp starts a team the first time a parallel region asks for it, and when the
 * system refuses a thread (a cgroup's pids limit, ulimit -u, an address-space limit
 * that the stacks exhaust) it prints "Thread creation failed" and exits the process.
 * So the CPU backend first starts the same number of plain POSIX threads, default
 * attributes like libgomp's (no OMP_STACKSIZE), each parked on one gate until all are
 * started or one is refused; then it opens the gate and joins them. No allocation in
 * the threads themselves, so the probe asks for what the OpenMP team will ask for. */
#include "thread_probe.h"

#include <stdlib.h>

#ifdef _WIN32
int cyllm_probe_threads(int n) { return n; }   /* no libgomp exit to forestall there */
#else
#include <pthread.h>

typedef struct {
    pthread_mutex_t m;
    pthread_cond_t c;
    int open;
} probe_gate;

static void* probe_park(void* arg)
{
    probe_gate* g = (probe_gate*)arg;
    pthread_mutex_lock(&g->m);
    while (!g->open) pthread_cond_wait(&g->c, &g->m);
    pthread_mutex_unlock(&g->m);
    return NULL;
}

int cyllm_probe_threads(int n)
{
    if (n <= 1) return n < 1 ? 0 : 1;
    pthread_t* t = (pthread_t*)malloc(sizeof(pthread_t) * (size_t)(n - 1));
    if (t == NULL) return 1;
    probe_gate g;
    pthread_mutex_init(&g.m, NULL);
    pthread_cond_init(&g.c, NULL);
    g.open = 0;
    int started = 0;
    while (started < n - 1 && pthread_create(&t[started], NULL, probe_park, &g) == 0) ++started;
    pthread_mutex_lock(&g.m);
    g.open = 1;
    pthread_cond_broadcast(&g.c);
    pthread_mutex_unlock(&g.m);
    for (int i = 0; i < started; ++i) pthread_join(t[i], NULL);
    pthread_cond_destroy(&g.c);
    pthread_mutex_destroy(&g.m);
    free(t);
    return started + 1;      /* the calling thread is the team's first member */
}
#endif
