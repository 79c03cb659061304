/* Fault injection switched on by QUERN_FAULT (see common/fault.h). */
#include "common/fault.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_site[64]; /* the site to fault, "" when off */
static long g_nth;      /* fire at this call (1-based) */
static int g_kill;      /* 1: SIGKILL, 0: return true */
static int g_sleep_s;   /* > 0: sleep this long, then go on (return false) */
static long g_calls;    /* calls of g_site so far */

static void fault_init(void)
{
    const char *spec = getenv("QUERN_FAULT");
    if (!spec || !*spec)
        return;
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", spec);
    char *n = strchr(buf, ':');
    if (!n)
        return;
    *n++ = 0;
    char *action = strchr(n, ':');
    if (action)
        *action++ = 0;
    g_nth = strtol(n, NULL, 10);
    if (action && !strncmp(action, "sleep=", 6) && (g_sleep_s = atoi(action + 6)) <= 0)
        return; /* (not a duration: no fault, rather than a kill or a sleep for ever) */
    g_kill = !g_sleep_s && (!action || strcmp(action, "fail") != 0);
    if (g_nth > 0)
        snprintf(g_site, sizeof(g_site), "%.63s", buf);
}

bool fault_hit(const char *site)
{
    pthread_once(&g_once, fault_init);
    if (!g_site[0] || strcmp(site, g_site) != 0)
        return false;
    pthread_mutex_lock(&g_lock);
    long call = ++g_calls;
    pthread_mutex_unlock(&g_lock);
    if (call != g_nth)
        return false;
    char msg[160];
    int len = snprintf(msg, sizeof(msg), "quern fault: %s #%ld: %s\n", site, call,
                       g_kill      ? "kill"
                       : g_sleep_s ? "sleep"
                                   : "fail");
    if (write(2, msg, (size_t)len) < 0) {
        /* nothing to do: the fault fires either way */
    }
    if (g_kill)
        raise(SIGKILL);
    if (g_sleep_s) {
        for (unsigned left = (unsigned)g_sleep_s; left;)
            left = sleep(left); /* (a signal cuts it short: sleep on) */
        return false;
    }
    return true;
}
