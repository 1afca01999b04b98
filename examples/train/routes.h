/* train/routes.h - routing record and replay for the model of examples/train_model.h: the
   record's types, its file format, and tm_moe_call, the one MoE forward that records or replays.
   Part of train_model.h: it includes this file after tm_model (which holds a tm_routes pointer,
   declared ahead) and before the MoE blocks' forward, which calls tm_moe_call. */

/* Routing record and replay (train_moe --routing-record / --routing-replay): every MoE forward's
   decisions keyed by what a token is, whatever rank holds it: (phase, step, sub, sequence,
   position, layer) -> its K experts. phase: training (sub = the accumulation step, sequence =
   the sampler's sample index), validation (sub = the validation batch, sequence = the held-out
   window's number) or sampling (sub = the token being generated, sequence 0 = the prompt). A
   rank maps the rows of each MoE call to sequences and positions (tm_moe_call's row0: the first
   row's place in the rank's batch of T-token sequences). A record file holds "DSKROUTE", K
   (int32), then one record per token: 6 int64 keys and K int32 experts; each rank of a recording
   run writes its own file (tm_routes_open). */
enum { TM_ROUTES_OFF = 0, TM_ROUTES_RECORD, TM_ROUTES_REPLAY };
enum { TM_PHASE_TRAIN = 0, TM_PHASE_VAL, TM_PHASE_SAMPLE };
typedef struct tm_routes {
    int mode, K;
    FILE *f;             /* record: the file being written */
    int64_t n, *keys;    /* replay: the records' keys (6 each) */
    int32_t *experts;    /* replay: their experts (K each) */
    int64_t cap, *table; /* replay: open addressing over the records (index + 1, 0 = empty) */
    /* the forward in progress, set by the trainer */
    int phase, n_seq, seq_len;
    int64_t step, sub;
    const int64_t *seq_id; /* (n_seq) each local sequence's identity, NULL: its local index */
    int32_t *buf;          /* (rows, K) one call's decisions */
    int64_t buf_rows;
} tm_routes;

/* ---- routing record and replay */

static uint64_t tm_routes_hash(const int64_t *k) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < 6; i++) h = (h ^ (uint64_t)k[i]) * 1099511628211ull + (h >> 29);
    return h;
}

/* The key of row `row` (of the rank's batch) in MoE layer `layer` of the forward in progress. */
static dsk_status tm_routes_key(const tm_routes *r, int layer, int64_t row, int64_t key[6]) {
    int64_t b = row / r->seq_len;
    if (b >= r->n_seq)
        return dsk_set_error(DSK_ERR_STATE, "routing record/replay: row %lld is past the %d sequences of the batch",
                             (long long)row, r->n_seq);
    key[0] = r->phase;
    key[1] = r->step;
    key[2] = r->sub;
    key[3] = r->seq_id ? r->seq_id[b] : b;
    key[4] = row % r->seq_len;
    key[5] = layer;
    return DSK_OK;
}

/* Appends the records of one record file to r->keys, r->experts. */
static dsk_status tm_routes_read(tm_routes *r, FILE *f, const char *path) {
    char magic[8];
    int32_t k = 0;
    int K = r->K;
    if (fread(magic, 1, 8, f) != 8 || memcmp(magic, "DSKROUTE", 8) || fread(&k, 4, 1, f) != 1)
        return dsk_set_error(DSK_ERR_CORRUPT, "routing replay: %s is not a routing record", path);
    if (k != K)
        return dsk_set_error(DSK_ERR_ARG, "routing replay: %s holds top_k %d decisions, the model takes top_k %d", path,
                             (int)k, K);
    size_t rec = 6 * sizeof(int64_t) + (size_t)K * sizeof(int32_t), at = (size_t)ftell(f);
    fseek(f, 0, SEEK_END);
    size_t end = (size_t)ftell(f);
    fseek(f, (long)at, SEEK_SET);
    if ((end - at) % rec) return dsk_set_error(DSK_ERR_CORRUPT, "routing replay: %s ends inside a record", path);
    int64_t n0 = r->n, n = n0 + (int64_t)((end - at) / rec);
    int64_t *keys = (int64_t *)realloc(r->keys, (size_t)(n ? n : 1) * 6 * sizeof(int64_t));
    if (keys) r->keys = keys;
    int32_t *experts = (int32_t *)realloc(r->experts, (size_t)(n ? n : 1) * (size_t)K * sizeof(int32_t));
    if (experts) r->experts = experts;
    if (!keys || !experts) return dsk_set_error(DSK_ERR_OOM, "routing replay: out of memory");
    for (int64_t i = n0; i < n; i++)
        if (fread(r->keys + 6 * i, sizeof(int64_t), 6, f) != 6 ||
            fread(r->experts + (size_t)K * i, sizeof(int32_t), (size_t)K, f) != (size_t)K)
            return dsk_set_error(DSK_ERR_IO, "routing replay: cannot read record %lld of %s", (long long)(i - n0),
                                 path);
    r->n = n;
    return DSK_OK;
}

/* Record: opens the file this rank writes (rank 0 `path`, rank r > 0 `path`.rank<r>). Replay:
   reads the records of `path` and of `path`.rank1, .rank2, ... while they exist into the table
   (the keys are global, so a layout reads whatever ranks recorded them). */
static dsk_status tm_routes_open(tm_routes *r, int mode, const char *path, int K, int rank) {
    char name[4096];
    int32_t k = K;
    memset(r, 0, sizeof *r);
    r->mode = mode;
    r->K = K;
    if (mode == TM_ROUTES_RECORD) {
        snprintf(name, sizeof name, rank > 0 ? "%s.rank%d" : "%s", path, rank);
        if (!(r->f = fopen(name, "wb"))) return dsk_set_error(DSK_ERR_IO, "routing record: cannot open %s", name);
        if (fwrite("DSKROUTE", 1, 8, r->f) != 8 || fwrite(&k, 4, 1, r->f) != 1)
            return dsk_set_error(DSK_ERR_IO, "routing record: cannot write %s", name);
        return DSK_OK;
    }
    for (int i = 0;; i++) {
        snprintf(name, sizeof name, i > 0 ? "%s.rank%d" : "%s", path, i);
        FILE *f = fopen(name, "rb");
        if (!f && i == 0) return dsk_set_error(DSK_ERR_IO, "routing replay: cannot open %s", name);
        if (!f) break;
        dsk_status s = tm_routes_read(r, f, name);
        fclose(f);
        TM_TRY(s);
    }
    for (r->cap = 16; r->cap < 2 * r->n; r->cap *= 2) {}
    r->table = (int64_t *)calloc((size_t)r->cap, sizeof(int64_t));
    if (!r->table) return dsk_set_error(DSK_ERR_OOM, "routing replay: out of memory");
    for (int64_t i = 0; i < r->n; i++) {
        uint64_t h = tm_routes_hash(r->keys + 6 * i) & (uint64_t)(r->cap - 1);
        while (r->table[h] && memcmp(r->keys + 6 * (r->table[h] - 1), r->keys + 6 * i, 6 * sizeof(int64_t)))
            h = (h + 1) & (uint64_t)(r->cap - 1);
        r->table[h] = i + 1; /* a key recorded twice (a forward run again, the same sample on two ranks): the later */
    }
    return DSK_OK;
}

static dsk_status tm_routes_close(tm_routes *r) {
    dsk_status s = DSK_OK;
    if (r->f && fclose(r->f) != 0) s = dsk_set_error(DSK_ERR_IO, "routing record: cannot finish the file");
    free(r->keys);
    free(r->experts);
    free(r->table);
    free(r->buf);
    memset(r, 0, sizeof *r);
    return s;
}

/* The decisions for n rows from row0 into r->buf (replay); a row of the sampling phase that the
   record lacks (the filler sequences of a pipeline's micro-batch, which nothing reads) takes
   experts 0 .. K-1; any other missing row is an error naming its key. */
static dsk_status tm_routes_lookup(tm_routes *r, int layer, int64_t row0, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int64_t key[6] = {0};
        TM_TRY(tm_routes_key(r, layer, row0 + i, key));
        uint64_t h = tm_routes_hash(key) & (uint64_t)(r->cap - 1);
        while (r->table[h] && memcmp(r->keys + 6 * (r->table[h] - 1), key, sizeof key))
            h = (h + 1) & (uint64_t)(r->cap - 1);
        if (r->table[h]) {
            memcpy(r->buf + i * r->K, r->experts + (size_t)r->K * (r->table[h] - 1), (size_t)r->K * sizeof(int32_t));
            continue;
        }
        if (r->phase != TM_PHASE_SAMPLE || key[3] == 0)
            return dsk_set_error(DSK_ERR_ARG,
                                 "routing replay: no decision recorded for phase %lld step %lld sub %lld sequence %lld "
                                 "position %lld layer %lld (was the record made with the same data and steps?)",
                                 (long long)key[0], (long long)key[1], (long long)key[2], (long long)key[3],
                                 (long long)key[4], (long long)key[5]);
        for (int k = 0; k < r->K; k++) r->buf[i * r->K + k] = k;
    }
    return DSK_OK;
}

/* Writes the decisions of n rows from row0 (r->buf); in the sampling phase only the prompt's
   sequence (the filler sequences of a pipeline's micro-batch differ between ranks). */
static dsk_status tm_routes_write(tm_routes *r, int layer, int64_t row0, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int64_t key[6] = {0};
        TM_TRY(tm_routes_key(r, layer, row0 + i, key));
        if (r->phase == TM_PHASE_SAMPLE && key[3] != 0) continue;
        if (fwrite(key, sizeof(int64_t), 6, r->f) != 6 ||
            fwrite(r->buf + i * r->K, sizeof(int32_t), (size_t)r->K, r->f) != (size_t)r->K)
            return dsk_set_error(DSK_ERR_IO, "routing record: cannot write");
    }
    return DSK_OK;
}

/* One MoE forward y = MoE(x) of block `layer` over x's rows, row0 the first one's place in the
   rank's batch: recorded or replayed when m->routes asks for it. */
static dsk_status tm_moe_call(tm_model *m, dsk_moe *moe, int layer, int64_t row0, dsk_tensor *y, const dsk_tensor *x,
                              dsk_moe_stats *st) {
    tm_routes *r = m->routes;
    int64_t n = x->shape[0], shape[2] = {n, r ? r->K : 0};
    dsk_tensor e;
    TM_TRY(dsk_moe_set_loss_span(moe, m->loss_group, m->loss_row0, m->loss_rows));
    if (!r || r->mode == TM_ROUTES_OFF) return dsk_moe_forward(moe, m->ctx, y, x, st);
    if (n > r->buf_rows) {
        free(r->buf);
        r->buf = (int32_t *)malloc((size_t)n * (size_t)r->K * sizeof(int32_t));
        r->buf_rows = r->buf ? n : 0;
        if (!r->buf) return dsk_set_error(DSK_ERR_OOM, "routing record/replay: out of memory");
    }
    TM_TRY(dsk_tensor_wrap(&e, r->buf, DSK_I32, dsk_cpu(), 2, shape));
    if (r->mode == TM_ROUTES_RECORD) {
        TM_TRY(dsk_moe_forward(moe, m->ctx, y, x, st));
        TM_TRY(dsk_moe_routing(moe, m->ctx, &e));
        return tm_routes_write(r, layer, row0, n);
    }
    TM_TRY(tm_routes_lookup(r, layer, row0, n));
    return dsk_moe_forward_replay(moe, m->ctx, y, x, &e, st);
}
