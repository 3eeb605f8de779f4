/* LD_PRELOAD this into a process that crashes without a native stack: on SIGSEGV,
 * SIGBUS or SIGABRT it prints the C/C++ frames (exported symbols) to stderr, then lets
 * the signal end the process as before. Used by probe_reload.py where no gdb is.
 *   gcc -shared -fPIC -o segv_backtrace.so segv_backtrace.c */
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void dump(int sig) {
    void *frames[64];
    int n = backtrace(frames, 64);
    const char line[] = "--- native stack at the signal:\n";
    write(2, line, sizeof line - 1);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    void *warm[1];
    backtrace(warm, 1); /* loads libgcc before any crash, where dlopen is unsafe */
    signal(SIGSEGV, dump);
    signal(SIGBUS, dump);
    signal(SIGABRT, dump);
}
