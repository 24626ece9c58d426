/* expand.h: a row of the types multiplied through their expansion (expand.c): int8 values v with a scale (and
 * for some types a min) per 16, w = sc[i / 16] v[i] (+ mn[i / 16]), each the type's value exactly. */
#ifndef DS_EXPAND_H
#define DS_EXPAND_H

#include "quants.h"

/* v [K], sc [K / 16], mn [K / 16] (mn left unwritten, and 0 returned, for the types without a min; -1: a type it
 * does not expand) */
DS_INTERNAL int expand_row(int type, const uint8_t *b, int K, int8_t *v, float *sc, float *mn);

#endif
