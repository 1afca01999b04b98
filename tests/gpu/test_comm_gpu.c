/* test_comm_gpu.c - the nccl backend of dsk_comm.h against the host backend.

   The parent starts 2, then 4 ranks (one per GPU, where there are that many) with
   dsk_comm_spawn_local, re-running this binary with --rank-child PART so every rank is a
   fresh process. Each rank opens an nccl communicator (device buffers on its own CUDA
   context) and a host communicator on the next port, runs the same collective on the same
   inputs through both and compares: bitwise for data movement, max and min and integer
   sums; within the dtype's tolerance for float sums and averages (NCCL adds in its own
   order and rounds every partial sum). On one GPU the world has one rank, which still runs
   every call through NCCL. Without a usable CUDA device every case is skipped. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, readlink, dirent: the library is linked, not included */
#include "../../dsk_comm.h"
#include "../../dsk_moe.h" /* its expert-parallel routes */
#include "tests/dsk_test.h"
#include "tests/gpu/gpu_test_spawn.h"

#ifdef DSK_CUDA
#include <cuda_runtime.h>

static dsk_comm NC, HC; /* nccl and host communicators of this rank */
static dsk_ctx G;

/* Rank r's input for `tag`: floats in [-2, 2) exact in the dtype, small integers. */
static void gen(void *buf, dsk_dtype dt, int64_t n, uint64_t tag, int r) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t u = dsk_test_mix64(dsk_test_mix64(tag * 131 + (uint64_t)r) ^ (uint64_t)i * 0xD1B54A32D192ED03ull);
        double d = (double)(u >> 11) * (1.0 / 9007199254740992.0) * 4.0 - 2.0;
        float f = (float)d;
        switch (dt) {
        case DSK_F32: ((float *)buf)[i] = f; break;
        case DSK_F64: ((double *)buf)[i] = d; break;
        case DSK_F16: ((uint16_t *)buf)[i] = dsk_f32_to_f16(f); break;
        case DSK_BF16: ((uint16_t *)buf)[i] = dsk_f32_to_bf16(f); break;
        case DSK_I32: ((int32_t *)buf)[i] = (int32_t)(u >> 36) - (1 << 27); break;
        case DSK_I64: ((int64_t *)buf)[i] = (int64_t)(u >> 4) - ((int64_t)1 << 59); break;
        default: ((uint8_t *)buf)[i] = (uint8_t)(u >> 58); break;
        }
    }
}

static void *dev_from(const void *host, size_t bytes) {
    void *d = NULL;
    DSK_TEST_EXPECT(cudaMalloc(&d, bytes ? bytes : 1) == cudaSuccess, "cudaMalloc %zu", bytes);
    if (d) DSK_TEST_OK(dsk_cuda_memcpy_sync(d, host, bytes, 1)); /* the bytes landed: nccl's stream does not wait */
    return d;
}
/* Device memory of `bytes` filled with 0xff bytes (NaN in every float dtype): outputs start poisoned. */
static void *dev_poisoned(size_t bytes) {
    void *d = NULL;
    DSK_TEST_EXPECT(cudaMalloc(&d, bytes ? bytes : 1) == cudaSuccess, "cudaMalloc %zu", bytes);
    if (d) DSK_TEST_EXPECT(cudaMemset(d, 0xff, bytes ? bytes : 1) == cudaSuccess, "cudaMemset");
    return d;
}
static void to_host(void *host, const void *dev, size_t bytes) {
    DSK_TEST_OK(dsk_comm_sync(&NC, &G));
    if (bytes) DSK_TEST_EXPECT(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost) == cudaSuccess, "to host");
}

/* Allowed difference of two float sums over `ranks` inputs in [-2, 2) that add in different
   orders: each side rounds every partial sum (magnitude below 2 ranks) to the dtype, ranks - 1
   times plus once at the end, half a unit in the last place (2^-p relative) each time. */
static double sum_tolerance(dsk_dtype dt, int ranks) {
    int p = dt == DSK_BF16 ? 8 : dt == DSK_F16 ? 11 : 24;
    return (double)ranks * 2.0 * ranks * ldexp(1.0, -p) + (dt == DSK_F32 ? 1e-5 : 0);
}

/* got (from NCCL) vs want (host backend): bitwise, or within the dtype's tolerance. */
static void compare(const void *got, const void *want, dsk_dtype dt, int64_t n, int exact, const char *what) {
    if (exact || !dsk_dtype_is_float(dt)) {
        DSK_TEST_SAME_BYTES(got, want, (size_t)n * dsk_dtype_size(dt), what);
        return;
    }
    if (dt == DSK_F64) {
        double *w = (double *)malloc((size_t)(n ? n : 1) * sizeof(double));
        memcpy(w, want, (size_t)n * sizeof(double));
        DSK_TEST_CLOSE64((const double *)got, w, n, 1e-13, 1e-13, what);
        free(w);
        return;
    }
    {
        float *g = (float *)malloc((size_t)(n ? n : 1) * sizeof(float));
        double *w = (double *)malloc((size_t)(n ? n : 1) * sizeof(double));
        for (int64_t i = 0; i < n; i++) {
            if (dt == DSK_F32) {
                g[i] = ((const float *)got)[i];
                w[i] = ((const float *)want)[i];
            } else if (dt == DSK_BF16) {
                g[i] = dsk_bf16_to_f32(((const uint16_t *)got)[i]);
                w[i] = dsk_bf16_to_f32(((const uint16_t *)want)[i]);
            } else {
                g[i] = dsk_f16_to_f32(((const uint16_t *)got)[i]);
                w[i] = dsk_f16_to_f32(((const uint16_t *)want)[i]);
            }
        }
        DSK_TEST_CLOSE(g, w, n, dt == DSK_F32 ? 1e-5 : 1e-2, sum_tolerance(dt, NC.world_size), what);
        free(g);
        free(w);
    }
}

/* dsk_comm_all_to_all_v_notify's reports on nccl: every rank, in rank order (the messages are stream-ordered). */
static int g_told[8], g_told_n;
static void record_arrival(void *arg, int p) {
    (void)arg;
    if (g_told_n < 8) g_told[g_told_n] = p;
    g_told_n++;
}

static const dsk_dtype k_dtypes[] = {DSK_F32, DSK_F16, DSK_BF16, DSK_F64, DSK_I32, DSK_I64, DSK_U8};
static const int64_t k_sizes[] = {1, 7, 129, 70001};

static void part_collectives(void) {
    int n = NC.world_size, me = NC.rank;
    uint64_t tag = 1;
    for (size_t d = 0; d < sizeof k_dtypes / sizeof *k_dtypes; d++)
        for (size_t s = 0; s < 4; s++) {
            dsk_dtype dt = k_dtypes[d];
            size_t esz = dsk_dtype_size(dt);
            int64_t len = k_sizes[s], per = len;
            size_t bytes = (size_t)len * esz, nb = bytes * (size_t)n;
            char *in = (char *)malloc(nb), *want = (char *)malloc(nb), *got = (char *)malloc(nb), label[160];
            void *din, *dout;
            int64_t sc[8], rc[8];
            gen(in, dt, len * n, tag++, me);
            din = dev_from(in, nb);
            dout = dev_from(in, nb);
            for (int o = 0; o < 4; o++) {
                dsk_comm_op op = (dsk_comm_op)o;
                if (op == DSK_COMM_AVG && !dsk_dtype_is_float(dt)) continue;
                snprintf(label, sizeof label, "rank %d: all_reduce %s %s count %lld", me, dsk_dtype_name(dt),
                         dsk_comm_op_name(op), (long long)len);
                DSK_TEST_OK(dsk_comm_all_reduce(&HC, NULL, in, want, len, dt, op));
                DSK_TEST_OK(dsk_comm_all_reduce(&NC, &G, din, dout, len, dt, op));
                to_host(got, dout, bytes);
                compare(got, want, dt, len, op == DSK_COMM_MAX || op == DSK_COMM_MIN, label);
                snprintf(label, sizeof label, "rank %d: reduce %s %s count %lld root %d", me, dsk_dtype_name(dt),
                         dsk_comm_op_name(op), (long long)len, n - 1);
                DSK_TEST_OK(dsk_comm_reduce(&HC, NULL, in, want, len, dt, op, n - 1));
                DSK_TEST_OK(dsk_comm_reduce(&NC, &G, din, dout, len, dt, op, n - 1));
                to_host(got, dout, bytes);
                if (me == n - 1) compare(got, want, dt, len, op == DSK_COMM_MAX || op == DSK_COMM_MIN, label);
                snprintf(label, sizeof label, "rank %d: reduce_scatter %s %s block %lld", me, dsk_dtype_name(dt),
                         dsk_comm_op_name(op), (long long)per);
                DSK_TEST_OK(dsk_comm_reduce_scatter(&HC, NULL, in, want, per, dt, op));
                DSK_TEST_OK(dsk_comm_reduce_scatter(&NC, &G, din, dout, per, dt, op));
                to_host(got, dout, bytes);
                compare(got, want, dt, per, op == DSK_COMM_MAX || op == DSK_COMM_MIN, label);
            }
            snprintf(label, sizeof label, "rank %d: all_gather %s count %lld", me, dsk_dtype_name(dt), (long long)per);
            DSK_TEST_OK(dsk_comm_all_gather(&HC, NULL, in, want, per, dt));
            DSK_TEST_OK(dsk_comm_all_gather(&NC, &G, din, dout, per, dt));
            to_host(got, dout, nb);
            compare(got, want, dt, per * n, 1, label);
            snprintf(label, sizeof label, "rank %d: broadcast %s count %lld root %d", me, dsk_dtype_name(dt),
                     (long long)len, n - 1);
            DSK_TEST_OK(dsk_comm_broadcast(&HC, NULL, in, want, len, dt, n - 1));
            DSK_TEST_OK(dsk_comm_broadcast(&NC, &G, din, dout, len, dt, n - 1));
            to_host(got, dout, bytes);
            compare(got, want, dt, len, 1, label);
            snprintf(label, sizeof label, "rank %d: gather %s count %lld root 0", me, dsk_dtype_name(dt),
                     (long long)per);
            DSK_TEST_OK(dsk_comm_gather(&HC, NULL, in, want, per, dt, 0));
            DSK_TEST_OK(dsk_comm_gather(&NC, &G, din, dout, per, dt, 0));
            to_host(got, dout, nb);
            if (me == 0) compare(got, want, dt, per * n, 1, label);
            snprintf(label, sizeof label, "rank %d: scatter %s count %lld root 0", me, dsk_dtype_name(dt),
                     (long long)per);
            DSK_TEST_OK(dsk_comm_scatter(&HC, NULL, in, want, per, dt, 0));
            DSK_TEST_OK(dsk_comm_scatter(&NC, &G, din, dout, per, dt, 0));
            to_host(got, dout, bytes);
            compare(got, want, dt, per, 1, label);
            snprintf(label, sizeof label, "rank %d: all_to_all %s block %lld", me, dsk_dtype_name(dt), (long long)per);
            DSK_TEST_OK(dsk_comm_all_to_all(&HC, NULL, in, want, per, dt));
            DSK_TEST_OK(dsk_comm_all_to_all(&NC, &G, din, dout, per, dt));
            to_host(got, dout, nb);
            compare(got, want, dt, per * n, 1, label);
            /* all_to_all_v: rank p sends (p + q + s) % 3 * len / 3 elements to q, zeros included */
            for (int q = 0; q < n; q++) {
                sc[q] = (int64_t)((me + q + (int)s) % 3) * len / 3;
                rc[q] = (int64_t)((q + me + (int)s) % 3) * len / 3;
            }
            snprintf(label, sizeof label, "rank %d: all_to_all_v %s scale %lld", me, dsk_dtype_name(dt),
                     (long long)len);
            memset(want, 0, nb);
            DSK_TEST_EXPECT(cudaMemset(dout, 0, nb) == cudaSuccess, "cudaMemset");
            DSK_TEST_OK(dsk_comm_all_to_all_v(&HC, NULL, in, sc, NULL, want, rc, NULL, dt));
            DSK_TEST_OK(dsk_comm_all_to_all_v(&NC, &G, din, sc, NULL, dout, rc, NULL, dt));
            to_host(got, dout, nb);
            compare(got, want, dt, len * n, 1, label);
            DSK_TEST_EXPECT(cudaMemset(dout, 0, nb) == cudaSuccess, "cudaMemset");
            g_told_n = 0;
            DSK_TEST_OK(dsk_comm_all_to_all_v_notify(&NC, &G, din, sc, NULL, dout, rc, NULL, dt, record_arrival, NULL));
            DSK_TEST_EXPECT(g_told_n == n, "%s: notify reported %d ranks of %d", label, g_told_n, n);
            for (int q = 0; q < n && q < g_told_n && q < 8; q++)
                DSK_TEST_EXPECT(g_told[q] == q, "%s: notify's report %d is rank %d", label, q, g_told[q]);
            to_host(got, dout, nb);
            compare(got, want, dt, len * n, 1, label);
            { /* begun, moved on and finished: enqueued at the start, nothing left unsent, every rank landed (the
                 stream orders what follows), one call counted */
                size_t unsent = 1;
                int64_t calls = NC.stats.calls;
                int landed[8] = {0};
                DSK_TEST_EXPECT(cudaMemset(dout, 0, nb) == cudaSuccess, "cudaMemset");
                DSK_TEST_OK(dsk_comm_all_to_all_v_start(&NC, &G, din, sc, NULL, dout, rc, NULL, dt, &unsent));
                DSK_TEST_EXPECT(unsent == 0, "%s: nccl start left %zu bytes unsent", label, unsent);
                unsent = 1;
                DSK_TEST_OK(dsk_comm_progress(&NC, &G, 1, landed, &unsent));
                DSK_TEST_EXPECT(unsent == 0, "%s: nccl progress says %zu bytes unsent", label, unsent);
                for (int q = 0; q < n && q < 8; q++)
                    DSK_TEST_EXPECT(landed[q] == 1, "%s: nccl progress: rank %d not landed", label, q);
                DSK_TEST_OK(dsk_comm_finish(&NC, &G));
                DSK_TEST_EXPECT(NC.stats.calls == calls + 1, "%s: start and finish counted %lld calls", label,
                                (long long)(NC.stats.calls - calls));
                to_host(got, dout, nb);
                compare(got, want, dt, len * n, 1, label);
            }
            if (n > 1) { /* begun point to point: enqueued in order (even ranks send first), waits return at once */
                int next = (me + 1) % n, prev = (me + n - 1) % n;
                int64_t req[2];
                snprintf(label, sizeof label, "rank %d: send_start/recv_start %s count %lld", me, dsk_dtype_name(dt),
                         (long long)len);
                if (me % 2 == 0) {
                    DSK_TEST_OK(dsk_comm_send(&HC, NULL, in, len, dt, next));
                    DSK_TEST_OK(dsk_comm_recv(&HC, NULL, want, len, dt, prev));
                    DSK_TEST_OK(dsk_comm_send_start(&NC, &G, din, len, dt, next, &req[0]));
                    DSK_TEST_OK(dsk_comm_recv_start(&NC, &G, dout, len, dt, prev, &req[1]));
                } else {
                    DSK_TEST_OK(dsk_comm_recv(&HC, NULL, want, len, dt, prev));
                    DSK_TEST_OK(dsk_comm_send(&HC, NULL, in, len, dt, next));
                    DSK_TEST_OK(dsk_comm_recv_start(&NC, &G, dout, len, dt, prev, &req[1]));
                    DSK_TEST_OK(dsk_comm_send_start(&NC, &G, din, len, dt, next, &req[0]));
                }
                DSK_TEST_OK(dsk_comm_wait(&NC, &G, req[1]));
                DSK_TEST_OK(dsk_comm_wait(&NC, &G, DSK_COMM_ALL_REQUESTS));
                to_host(got, dout, bytes);
                compare(got, want, dt, len, 1, label);
            }
            DSK_TEST_EXPECT(cudaFree(din) == cudaSuccess && cudaFree(dout) == cudaSuccess, "cudaFree");
            free(in);
            free(want);
            free(got);
        }
    DSK_TEST_OK(dsk_comm_barrier(&NC, &G));
}

static void part_split(void) {
    int me = NC.rank;
    dsk_comm ns, hs;
    float x[33], want[33], got[33];
    void *d;
    DSK_TEST_OK(dsk_comm_split(&NC, me % 2, -me, &ns));
    DSK_TEST_OK(dsk_comm_split(&HC, me % 2, -me, &hs));
    DSK_TEST_EXPECT(ns.rank == hs.rank && ns.world_size == hs.world_size && ns.backend == DSK_COMM_NCCL,
                    "nccl sub-group rank %d of %d, host %d of %d", ns.rank, ns.world_size, hs.rank, hs.world_size);
    DSK_TEST_EXPECT(ns.n_nodes == hs.n_nodes && ns.node == hs.node && ns.node_rank == hs.node_rank &&
                        ns.node_size == hs.node_size,
                    "nccl sub-group node %d of %d (index %d of %d), host %d of %d (%d of %d)", ns.node, ns.n_nodes,
                    ns.node_rank, ns.node_size, hs.node, hs.n_nodes, hs.node_rank, hs.node_size);
    gen(x, DSK_F32, 33, 77, me);
    d = dev_from(x, sizeof x);
    DSK_TEST_OK(dsk_comm_all_reduce(&hs, NULL, x, want, 33, DSK_F32, DSK_COMM_MAX));
    DSK_TEST_OK(dsk_comm_all_reduce(&ns, &G, d, d, 33, DSK_F32, DSK_COMM_MAX));
    DSK_TEST_OK(dsk_comm_sync(&ns, &G));
    DSK_TEST_EXPECT(cudaMemcpy(got, d, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess, "to host");
    DSK_TEST_SAME_BYTES(got, want, sizeof got, "sub-group max, nccl vs host");
    cudaFree(d);
    dsk_comm_free(&ns);
    dsk_comm_free(&hs);
}

/* Routes on device rows (nccl) vs host rows: flat and two-hop, dispatch and combine, bitwise;
   f32 rows of 5 (gathered as 32-bit words) and bf16 rows of 3 (6 bytes, 16-bit words). */
static void part_routes(void) {
    int n = NC.world_size, me = NC.rank, k = 3;
    int64_t rows = 23 + 4 * me;
    int32_t *dest = (int32_t *)malloc((size_t)rows * k * sizeof(int32_t));
    for (int64_t q = 0; q < rows * k; q++)
        dest[q] = (int32_t)(dsk_test_mix64(55 + (uint64_t)me * 1000 + (uint64_t)q) % (uint64_t)(n + 1)) - 1;
    DSK_TEST_EXPECT(NC.n_nodes == HC.n_nodes && NC.n_nodes == (n > 1 ? 2 : 1), "nodes: nccl %d, host %d",
                    NC.n_nodes, HC.n_nodes);
    for (int two = 0; two < 2; two++)
        for (int d = 0; d < 2; d++) {
            dsk_moe_route nr, hr;
            dsk_moe_route_opts o;
            dsk_dtype dt = d ? DSK_BF16 : DSK_F32;
            int64_t E = d ? 3 : 5;
            size_t row = (size_t)E * dsk_dtype_size(dt);
            char *in, *want, *got, *back_want, *back_got, label[96];
            void *din, *drecv, *dback;
            memset(&o, 0, sizeof o);
            o.two_hop = two;
            DSK_TEST_OK(dsk_moe_route_init(&hr, &HC, NULL, rows, k, dest, &o));
            DSK_TEST_OK(dsk_moe_route_init(&nr, &NC, &G, rows, k, dest, &o));
            if (!hr.impl || !nr.impl) return;
            DSK_TEST_EXPECT(nr.recv_rows == hr.recv_rows && nr.slots == hr.slots &&
                                nr.dispatch_rows_off_node == hr.dispatch_rows_off_node &&
                                nr.combine_rows_off_node == hr.combine_rows_off_node,
                            "route sizes differ");
            in = (char *)malloc((size_t)rows * row);
            want = (char *)malloc((size_t)(hr.recv_rows + 1) * row);
            got = (char *)malloc((size_t)(hr.recv_rows + 1) * row);
            back_want = (char *)malloc((size_t)(hr.slots + 1) * row);
            back_got = (char *)malloc((size_t)(hr.slots + 1) * row);
            gen(in, dt, rows * E, 600 + (uint64_t)d, me);
            din = dev_from(in, (size_t)rows * row);
            drecv = dev_poisoned((size_t)hr.recv_rows * row);
            dback = dev_poisoned((size_t)hr.slots * row);
            snprintf(label, sizeof label, "rank %d: %s route, %s rows", me, two ? "two-hop" : "flat",
                     dsk_dtype_name(dt));
            DSK_TEST_OK(dsk_moe_route_dispatch(&hr, NULL, in, E, dt, want));
            DSK_TEST_OK(dsk_moe_route_dispatch(&nr, &G, din, E, dt, drecv));
            to_host(got, drecv, (size_t)hr.recv_rows * row);
            DSK_TEST_SAME_BYTES(got, want, (size_t)hr.recv_rows * row, label);
            DSK_TEST_OK(dsk_moe_route_combine(&hr, NULL, want, E, dt, back_want));
            DSK_TEST_OK(dsk_moe_route_combine(&nr, &G, drecv, E, dt, dback));
            to_host(back_got, dback, (size_t)hr.slots * row);
            DSK_TEST_SAME_BYTES(back_got, back_want, (size_t)hr.slots * row, label);
            cudaFree(din);
            cudaFree(drecv);
            cudaFree(dback);
            free(in); free(want); free(got); free(back_want); free(back_got);
            dsk_moe_route_free(&nr);
            dsk_moe_route_free(&hr);
        }
    free(dest);
}

static int child_main(const char *part) {
    const char *rank = getenv("RANK"), *world = getenv("WORLD_SIZE");
    /* two emulated hosts (halves of the ranks) on both communicators: routes cross them in two hops */
    const char *host = atoi(rank ? rank : "0") < atoi(world ? world : "1") / 2 ? "gpu-host-a" : "gpu-host-b";
    if (gpu_test_rank_open(&NC, &HC, &G, host)) return 3;
    if (!strcmp(part, "collectives")) part_collectives();
    else if (!strcmp(part, "split")) part_split();
    else if (!strcmp(part, "routes")) part_routes();
    return gpu_test_rank_close(&NC, &HC, &G);
}
#endif

int main(int argc, char **argv) {
    static const char *parts[] = {"collectives", "split", "routes"};
    int ndev = 0, worlds[2] = {0, 0};
#ifdef DSK_CUDA
    if (argc > 2 && !strcmp(argv[1], "--rank-child")) return child_main(argv[2]);
#endif
    dsk_test_init("test_comm_gpu");
#ifdef DSK_CUDA
    if (dsk_cuda_available()) cudaGetDeviceCount(&ndev);
#endif
    /* 2 and 4 ranks, one per device, where there are that many devices; else one rank */
    worlds[0] = ndev >= 2 ? 2 : ndev;
    worlds[1] = ndev >= 4 ? 4 : 0;
    for (int w = 0; w < 2; w++)
        for (int p = 0; p < (int)(sizeof parts / sizeof parts[0]); p++) {
            if (w == 1 && worlds[1] == 0) continue;
            dsk_test_begin("nccl vs host backend, %d ranks: %s", worlds[w] ? worlds[w] : 1, parts[p]);
            if (ndev == 0) {
                dsk_test_skip("no usable CUDA device");
                continue;
            }
            gpu_test_spawn_self(worlds[w], parts[p]);
        }
    (void)argc;
    (void)argv;
    return dsk_test_finish();
}
