#include <pthread.h>
#include <stdatomic.h>
static atomic_int stop;
static void *spin(void *a) { volatile unsigned long x = 0; while (!atomic_load(&stop)) x++; return 0; }
int start_spinners(int n) { pthread_t t; for (int i = 0; i < n; i++) pthread_create(&t, 0, spin, 0); return 0; }
void stop_spinners(void) { atomic_store(&stop, 1); }
