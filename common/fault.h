/* Fault injection for the tests of the commit protocol. With QUERN_FAULT="SITE:N[:ACTION]" in
 * the environment, the Nth call of fault_hit("SITE") in this process fires: ACTION "kill" (the
 * default) writes one line to stderr and kills the process with SIGKILL on the spot; "fail"
 * makes fault_hit return true once, and the caller fails exactly as if the operation had failed
 * (an I/O error); "sleep=S" stalls the caller S seconds there and goes on (a slow disk or a long
 * model load), returning false. Without QUERN_FAULT, fault_hit is one branch on a cached flag.
 * Sites are named where they are called (shard.write, shard.fsync, queue.commit, manifest.write,
 * ...). */
#ifndef COMMON_FAULT_H
#define COMMON_FAULT_H

#include <stdbool.h>

/* Count one call of site; true when it must fail now (see above). Thread-safe. */
bool fault_hit(const char *site);

#endif
