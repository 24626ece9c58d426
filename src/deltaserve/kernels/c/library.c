/* library.c: the library's identity: its interface version (a cached library of another one is rebuilt) and the
 * build it is (kernels/native.py checks both before it binds anything). */
#include "ds.h"
#include "native.h"

#ifndef DS_BUILD
#define DS_BUILD "unnamed"
#endif

int ds_abi_version(void) { return DS_ABI; }

/* "<variant> <source key>": the instruction-set level it was built for and the hash of the sources it was built from
 * (kernels/native.py passes both as -DDS_BUILD), so that a library found in a shared directory is known to be these
 * sources' before it is used */
const char *ds_build_info(void) { return DS_BUILD; }
