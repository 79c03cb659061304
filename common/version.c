#include "common/version.h"

/* The Makefile defines QUERN_GIT for this file only, and compiles it again when it changes. */
#ifndef QUERN_GIT
#define QUERN_GIT "unknown"
#endif

const char *quern_version(void)
{
    return QUERN_GIT;
}
