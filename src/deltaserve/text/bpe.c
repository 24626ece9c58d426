/* A byte-level BPE held in ~14 MiB for Qwen's 248,320 tokens and 247,587 merges (see bpe.py for why).
 *
 * Tokens are byte-level strings (GPT-2's table: every byte is one character), kept as they are written in the
 * GGUF file, one buffer; a token id is found by its string in an open-addressing table of ids, a merge by its
 * pair of ids in another. The merge loop is `tokenizers`' own (BPE's Word::merge_all): a min-heap of candidate
 * merges ordered by rank, then position; an entry whose pair no longer gives the merge's token is skipped.
 * Nothing is written after ds_bpe_new: several threads may encode at once.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DS_BPE_ABI 1

typedef struct {
    int64_t n;            /* tokens */
    int64_t n_merges;
    char *text;           /* every token's string, one after another */
    int64_t *off;         /* token i is text[off[i] .. off[i+1]) */
    uint32_t *ids;        /* vocabulary slots: id + 1, 0 = empty */
    uint64_t id_mask;
    uint64_t *pair;       /* merge slots: (left << 32 | right) + 1, 0 = empty */
    uint32_t *rank, *made;
    uint64_t pair_mask;
    int32_t byte_id[256]; /* the token of each single byte, -1 if the vocabulary has none */
    int64_t bytes_held;
} ds_bpe;

/* GPT-2's byte <-> character table, as UTF-8: byte b is the character byte_char[b] (1 or 2 bytes) */
static unsigned char byte_utf8[256][2];
static unsigned char byte_len[256];
static int16_t char_byte[0x144]; /* code point -> byte, -1 for none */

static void tables(void) {
    static int ready = 0;
    if (ready) return;
    int shifted = 0;
    for (int c = 0; c < 0x144; c++) char_byte[c] = -1;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 0x21 && b < 0x7F) || (b >= 0xA1 && b < 0xAD) || (b >= 0xAE);
        int c = keep ? b : 0x100 + shifted++;
        char_byte[c] = (int16_t)b;
        if (c < 0x80) {
            byte_utf8[b][0] = (unsigned char)c;
            byte_len[b] = 1;
        } else {
            byte_utf8[b][0] = (unsigned char)(0xC0 | (c >> 6));
            byte_utf8[b][1] = (unsigned char)(0x80 | (c & 0x3F));
            byte_len[b] = 2;
        }
    }
    ready = 1;
}

static uint64_t hash_bytes(const char *s, int64_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (int64_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    return h ^ (h >> 29);
}

static uint64_t hash_pair(uint64_t k) {
    k *= 0x9E3779B97F4A7C15ULL;
    return k ^ (k >> 31);
}

static uint64_t pow2_at_least(uint64_t n) {
    uint64_t p = 16;
    while (p < n) p <<= 1;
    return p;
}

int64_t ds_bpe_lookup(const ds_bpe *m, const char *s, int64_t len) {
    uint64_t i = hash_bytes(s, len) & m->id_mask;
    for (;;) {
        uint32_t v = m->ids[i];
        if (!v) return -1;
        int64_t id = v - 1, a = m->off[id], n = m->off[id + 1] - a;
        if (n == len && memcmp(m->text + a, s, (size_t)len) == 0) return id;
        i = (i + 1) & m->id_mask;
    }
}

/* the slot of a pair, or of the empty slot where it would go */
static uint64_t pair_slot(const ds_bpe *m, uint64_t key) {
    uint64_t i = hash_pair(key) & m->pair_mask;
    while (m->pair[i] && m->pair[i] != key) i = (i + 1) & m->pair_mask;
    return i;
}

static int find_merge(const ds_bpe *m, uint32_t a, uint32_t b, uint32_t *rank, uint32_t *made) {
    uint64_t key = (((uint64_t)a << 32) | b) + 1;
    uint64_t i = pair_slot(m, key);
    if (!m->pair[i]) return 0;
    *rank = m->rank[i];
    *made = m->made[i];
    return 1;
}

void ds_bpe_free(ds_bpe *m) {
    if (!m) return;
    free(m->text);
    free(m->off);
    free(m->ids);
    free(m->pair);
    free(m->rank);
    free(m->made);
    free(m);
}

int ds_bpe_abi(void) { return DS_BPE_ABI; }

/* Walk a GGUF array of `count` strings (u64 length, then the bytes) from byte `pos` of buf[0 .. size): each
 * string's first byte into start[i] and its length into len[i]. Returns the byte after the last string, or -1 -
 * (the byte the first string that runs past the end needs) for a cut file. */
int64_t ds_gguf_strings(const unsigned char *buf, int64_t size, int64_t pos, int64_t count, int64_t *start,
                        int64_t *len) {
    for (int64_t i = 0; i < count; i++) {
        if (pos + 8 > size) return -1 - (pos + 8);
        uint64_t n;
        memcpy(&n, buf + pos, 8);
        pos += 8;
        if (n > (uint64_t)(size - pos)) return -1 - (int64_t)(pos + (int64_t)(n > (uint64_t)INT64_MAX / 2 ? INT64_MAX / 2 : n));
        start[i] = pos;
        len[i] = (int64_t)n;
        pos += (int64_t)n;
    }
    return pos;
}

/* Build from n token strings (base + start[i], len[i] bytes) and n_merges "left right" strings (mbase +
 * mstart[j], mlen[j]). skip[i] != 0: token i is padding and stays out of the vocabulary; a token whose string
 * an earlier token already has stays out too, and gets skip[i] = 2. On a bad merge: NULL, err[0] = 1 (not two
 * non-empty tokens around one space) or 2 (a part or the joined token is not in the vocabulary), err[1] = the
 * merge, err[2] = which (0 left, 1 right, 2 joined). NULL with err[0] = 3: out of memory. */
ds_bpe *ds_bpe_new(const char *base, const int64_t *start, const int64_t *len, int64_t n, uint8_t *skip,
                   const char *mbase, const int64_t *mstart, const int64_t *mlen, int64_t n_merges, int64_t *err) {
    tables();
    err[0] = err[1] = err[2] = 0;
    ds_bpe *m = calloc(1, sizeof *m);
    if (!m) { err[0] = 3; return NULL; }
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += len[i];
    m->n = n;
    m->n_merges = n_merges;
    m->text = malloc((size_t)(total ? total : 1));
    m->off = malloc(sizeof(int64_t) * (size_t)(n + 1));
    uint64_t id_slots = pow2_at_least((uint64_t)n * 2), pair_slots = pow2_at_least((uint64_t)n_merges * 2);
    m->id_mask = id_slots - 1;
    m->pair_mask = pair_slots - 1;
    m->ids = calloc(id_slots, sizeof(uint32_t));
    m->pair = calloc(pair_slots, sizeof(uint64_t));
    m->rank = malloc(pair_slots * sizeof(uint32_t));
    m->made = malloc(pair_slots * sizeof(uint32_t));
    if (!m->text || !m->off || !m->ids || !m->pair || !m->rank || !m->made) {
        ds_bpe_free(m);
        err[0] = 3;
        return NULL;
    }
    m->bytes_held = total + 8 * (n + 1) + 4 * (int64_t)id_slots + 16 * (int64_t)pair_slots;
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        m->off[i] = at;
        memcpy(m->text + at, base + start[i], (size_t)len[i]);
        at += len[i];
    }
    m->off[n] = at;
    for (int64_t i = 0; i < n; i++) {
        if (skip[i]) continue;
        const char *s = m->text + m->off[i];
        int64_t l = m->off[i + 1] - m->off[i];
        uint64_t k = hash_bytes(s, l) & m->id_mask;
        int dup = 0;
        while (m->ids[k]) {
            int64_t id = m->ids[k] - 1;
            if (m->off[id + 1] - m->off[id] == l && memcmp(m->text + m->off[id], s, (size_t)l) == 0) { dup = 1; break; }
            k = (k + 1) & m->id_mask;
        }
        if (dup) skip[i] = 2;
        else m->ids[k] = (uint32_t)(i + 1);
    }
    for (int b = 0; b < 256; b++) m->byte_id[b] = (int32_t)ds_bpe_lookup(m, (const char *)byte_utf8[b], byte_len[b]);
    char *joined = NULL;
    int64_t joined_cap = 0;
    for (int64_t j = 0; j < n_merges; j++) {
        const char *s = mbase + mstart[j];
        int64_t l = mlen[j], space = -1, spaces = 0;
        for (int64_t c = 0; c < l; c++) {
            if (s[c] == ' ') { spaces++; space = c; }
            else if (s[c] == '\n') spaces = 2;
        }
        if (spaces != 1 || space == 0 || space == l - 1) {
            err[0] = 1; err[1] = j;
            free(joined); ds_bpe_free(m);
            return NULL;
        }
        int64_t a = ds_bpe_lookup(m, s, space), b = ds_bpe_lookup(m, s + space + 1, l - space - 1);
        if (l > joined_cap) {
            free(joined);
            joined_cap = l * 2;
            joined = malloc((size_t)joined_cap);
            if (!joined) { err[0] = 3; ds_bpe_free(m); return NULL; }
        }
        memcpy(joined, s, (size_t)space);
        memcpy(joined + space, s + space + 1, (size_t)(l - space - 1));
        int64_t c = ds_bpe_lookup(m, joined, l - 1);
        if (a < 0 || b < 0 || c < 0) {
            err[0] = 2; err[1] = j; err[2] = a < 0 ? 0 : b < 0 ? 1 : 2;
            free(joined); ds_bpe_free(m);
            return NULL;
        }
        uint64_t key = (((uint64_t)a << 32) | (uint64_t)b) + 1;
        uint64_t k = pair_slot(m, key);
        m->pair[k] = key; /* a pair listed twice: the later rank (as tokenizers' map keeps) */
        m->rank[k] = (uint32_t)j;
        m->made[k] = (uint32_t)c;
    }
    free(joined);
    return m;
}

int64_t ds_bpe_bytes(const ds_bpe *m) { return m->bytes_held; }

/* the merges by rank: left[r], right[r] (-1 for a rank a later listing of the same pair replaced) */
int64_t ds_bpe_merges(const ds_bpe *m, int64_t *left, int64_t *right) {
    for (int64_t r = 0; r < m->n_merges; r++) left[r] = right[r] = -1;
    for (uint64_t k = 0; k <= m->pair_mask; k++) {
        if (!m->pair[k]) continue;
        uint64_t key = m->pair[k] - 1;
        left[m->rank[k]] = (int64_t)(key >> 32);
        right[m->rank[k]] = (int64_t)(key & 0xFFFFFFFFu);
    }
    return m->n_merges;
}

int64_t ds_bpe_merge_count(const ds_bpe *m) { return m->n_merges; }

/* the bytes of every token's string together */
int64_t ds_bpe_text_bytes(const ds_bpe *m) { return m->off[m->n]; }

/* token id's string as written (byte-level): *at = its offset into the buffer ds_bpe_text gives */
int64_t ds_bpe_token(const ds_bpe *m, int64_t id, int64_t *at) {
    if (id < 0 || id >= m->n) return -1;
    *at = m->off[id];
    return m->off[id + 1] - m->off[id];
}

const char *ds_bpe_text(const ds_bpe *m) { return m->text; }

/* the raw bytes a byte-level string stands for (a character outside GPT-2's table stands for its own UTF-8) */
static int64_t unmap(const unsigned char *s, int64_t l, unsigned char *out) {
    int64_t o = 0;
    for (int64_t i = 0; i < l;) {
        unsigned char c = s[i];
        int32_t cp = -1;
        int64_t w = 1;
        if (c < 0x80) cp = c;
        else if ((c & 0xE0) == 0xC0 && i + 1 < l) { cp = ((c & 0x1F) << 6) | (s[i + 1] & 0x3F); w = 2; }
        else if ((c & 0xF0) == 0xE0) w = 3;
        else if ((c & 0xF8) == 0xF0) w = 4;
        if (i + w > l) w = l - i;
        if (cp >= 0 && cp < 0x144 && char_byte[cp] >= 0) out[o++] = (unsigned char)char_byte[cp];
        else { memcpy(out + o, s + i, (size_t)w); o += w; }
        i += w;
    }
    return o;
}

/* Every token's raw bytes into out (room for the strings' total: unmapping never lengthens), token i's from
 * out[at[i]] to out[at[i + 1]]. Returns the bytes written. */
int64_t ds_bpe_pieces(const ds_bpe *m, unsigned char *out, int64_t *at) {
    int64_t o = 0;
    for (int64_t i = 0; i < m->n; i++) {
        at[i] = o;
        o += unmap((const unsigned char *)m->text + m->off[i], m->off[i + 1] - m->off[i], out + o);
    }
    at[m->n] = o;
    return o;
}

/* the most raw bytes a token not skipped stands for */
int64_t ds_bpe_longest(const ds_bpe *m, const uint8_t *skip, unsigned char *scratch) {
    int64_t best = 0;
    for (int64_t i = 0; i < m->n; i++) {
        if (skip[i]) continue;
        int64_t l = m->off[i + 1] - m->off[i];
        if (l <= best) continue; /* unmapping never lengthens */
        int64_t b = unmap((const unsigned char *)m->text + m->off[i], l, scratch);
        if (b > best) best = b;
    }
    return best;
}

typedef struct { uint32_t rank, pos, made; } merge_t;

static int before(merge_t a, merge_t b) { return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos); }

static void heap_push(merge_t *h, int64_t *n, merge_t x) {
    int64_t i = (*n)++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!before(x, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static merge_t heap_pop(merge_t *h, int64_t *n) {
    merge_t top = h[0], x = h[--(*n)];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && before(h[c + 1], h[c])) c++;
        if (!before(h[c], x)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = x;
    return top;
}

typedef struct { int32_t id, prev, next, alive; } symbol_t;

/* one pre-token's raw bytes -> ids; scratch holds 2 * l mapped bytes, l symbols and 3 * l heap entries */
static int64_t encode_word(const ds_bpe *m, const unsigned char *raw, int64_t l, int ignore_merges, int32_t *out,
                           char *mapped, symbol_t *sym, merge_t *heap) {
    if (ignore_merges) {
        int64_t k = 0;
        for (int64_t i = 0; i < l; i++) {
            memcpy(mapped + k, byte_utf8[raw[i]], byte_len[raw[i]]);
            k += byte_len[raw[i]];
        }
        int64_t id = ds_bpe_lookup(m, mapped, k);
        if (id >= 0) {
            out[0] = (int32_t)id;
            return 1;
        }
    }
    int64_t ns = 0;
    for (int64_t i = 0; i < l; i++) {
        int32_t id = m->byte_id[raw[i]];
        if (id < 0) continue; /* no token for this byte and no unknown token: tokenizers drops it too */
        sym[ns] = (symbol_t){id, (int32_t)ns - 1, (int32_t)ns + 1, 1};
        ns++;
    }
    if (!ns) return 0;
    sym[ns - 1].next = -1;
    int64_t nh = 0;
    uint32_t rank, made;
    for (int64_t i = 0; i + 1 < ns; i++)
        if (find_merge(m, (uint32_t)sym[i].id, (uint32_t)sym[i + 1].id, &rank, &made))
            heap_push(heap, &nh, (merge_t){rank, (uint32_t)i, made});
    while (nh) {
        merge_t top = heap_pop(heap, &nh);
        symbol_t *s = &sym[top.pos];
        if (!s->alive || s->next < 0) continue;
        symbol_t *r = &sym[s->next];
        if (!find_merge(m, (uint32_t)s->id, (uint32_t)r->id, &rank, &made) || made != top.made) continue;
        s->id = (int32_t)top.made;
        r->alive = 0;
        s->next = r->next;
        if (r->next >= 0) sym[r->next].prev = (int32_t)top.pos;
        if (s->prev >= 0 && find_merge(m, (uint32_t)sym[s->prev].id, (uint32_t)s->id, &rank, &made))
            heap_push(heap, &nh, (merge_t){rank, (uint32_t)s->prev, made});
        if (s->next >= 0 && find_merge(m, (uint32_t)s->id, (uint32_t)sym[s->next].id, &rank, &made))
            heap_push(heap, &nh, (merge_t){rank, top.pos, made});
    }
    int64_t o = 0;
    for (int64_t i = 0; i >= 0; i = sym[i].next) out[o++] = sym[i].id;
    return o;
}

static int64_t utf8_of(uint32_t c, unsigned char *o) {
    if (c < 0x80) { o[0] = (unsigned char)c; return 1; }
    if (c < 0x800) { o[0] = (unsigned char)(0xC0 | (c >> 6)); o[1] = (unsigned char)(0x80 | (c & 0x3F)); return 2; }
    if (c < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (c >> 12)); o[1] = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (c & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (c >> 18)); o[1] = (unsigned char)(0x80 | ((c >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((c >> 6) & 0x3F)); o[3] = (unsigned char)(0x80 | (c & 0x3F));
    return 4;
}

/* A text's tokens: `text` is its code points; piece t is either an id already (given[t] >= 0: an added token)
 * or the code points span[2t] .. span[2t + 1], encoded here. out has room for `cap` ids. Returns the ids
 * written, -1 when out is too small, -2 when memory runs out. */
int64_t ds_bpe_encode(const ds_bpe *m, const uint32_t *text, const int32_t *given, const int64_t *span, int64_t n,
                      int ignore_merges, int32_t *out, int64_t cap) {
    int64_t longest = 0;
    for (int64_t t = 0; t < n; t++)
        if (given[t] < 0 && span[2 * t + 1] - span[2 * t] > longest) longest = span[2 * t + 1] - span[2 * t];
    int64_t raw_cap = 4 * longest + 4;
    unsigned char *raw = malloc((size_t)raw_cap);
    char *mapped = malloc((size_t)(2 * raw_cap));
    symbol_t *sym = malloc(sizeof(symbol_t) * (size_t)raw_cap);
    merge_t *heap = malloc(sizeof(merge_t) * (size_t)(3 * raw_cap)); /* pushes: l - 1, then 2 per merge */
    int32_t *word = malloc(sizeof(int32_t) * (size_t)raw_cap);
    int64_t o = -2;
    if (!raw || !mapped || !sym || !heap || !word) goto done;
    o = 0;
    for (int64_t t = 0; t < n; t++) {
        if (given[t] >= 0) {
            if (o >= cap) { o = -1; goto done; }
            out[o++] = given[t];
            continue;
        }
        int64_t l = 0;
        for (int64_t c = span[2 * t]; c < span[2 * t + 1]; c++) l += utf8_of(text[c], raw + l);
        int64_t k = encode_word(m, raw, l, ignore_merges, word, mapped, sym, heap);
        if (o + k > cap) { o = -1; goto done; }
        memcpy(out + o, word, sizeof(int32_t) * (size_t)k);
        o += k;
    }
done:
    free(raw); free(mapped); free(sym); free(heap); free(word);
    return o;
}
