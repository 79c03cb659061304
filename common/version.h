/* Which quern this is: the source revision the binary was built from (`git describe --always
 * --dirty --abbrev=12` at build time, "unknown" outside a git checkout), for `quern --version`
 * and the engine description every run records with its outputs (docs/ARCHITECTURE.md,
 * "Provenance"). */
#ifndef COMMON_VERSION_H
#define COMMON_VERSION_H

/* "c2b1191a4f0e", "c2b1191a4f0e-dirty" or "unknown"; static storage. */
const char *quern_version(void);

#endif
