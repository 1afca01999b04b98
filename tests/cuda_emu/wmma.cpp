/* wmma.cpp - the warp-collective side of the emulated warp matrix functions (include/mma.h).

   A collective call publishes the lane's arguments in a table of its warp, then waits at the
   caller's site until all 32 lanes have arrived (the same rendezvous as a __syncwarp, so the
   emulator's lockstep rules apply: a lane that exited, a partial warp, or lanes that meet at
   different calls are faults). Each warp has two tables used in turn, so a lane that runs
   ahead into its next call cannot overwrite what a slower lane still reads. One block runs
   at a time, so the tables are indexed by warp only. */
#include "emu.h"
#include "mma.h"

#include <mutex>
#include <stdint.h>

namespace cuda_emu {
namespace wmma_impl {

namespace {

const int kWarps = 32; /* 1024 threads per block at most */
lane_args g_table[kWarps][2][32];
unsigned g_seq[kWarps][32]; /* collective calls made by each lane */
int16_t g_index[256], g_owner[256];
std::once_flag g_map_once;

/* The layout of every fragment: a permutation of the 256 positions from the emulator's seed. */
void make_map() {
    uint64_t st = cuda_emu_seed() ^ 0x57AA4D4Dull;
    for (int i = 0; i < 256; i++) g_index[i] = (int16_t)i;
    for (int i = 255; i > 0; i--) {
        int j = (int)(next_random(&st) % (uint64_t)(i + 1));
        int16_t t = g_index[i];
        g_index[i] = g_index[j];
        g_index[j] = t;
    }
    for (int i = 0; i < 256; i++) g_owner[g_index[i]] = (int16_t)i;
}

int linear_tid() { return (int)(cur->tid.x + cur->bdim.x * (cur->tid.y + cur->bdim.y * cur->tid.z)); }

const char *op_name(int op) {
    static const char *n[] = {"load of matrix_a", "load of matrix_b", "load of the accumulator", "store", "mma"};
    return op >= 0 && op <= OP_MMA ? n[op] : "wmma call";
}

} // namespace

int lane() { return linear_tid() % 32; }

const int16_t *element_indices() {
    std::call_once(g_map_once, make_map);
    return g_index;
}

const int16_t *element_owners() {
    std::call_once(g_map_once, make_map);
    return g_owner;
}

const lane_args *collective(const lane_args &mine, const char *name, size_t elem_bytes, const char *file, int line) {
    int tid = linear_tid(), w = tid / 32, l = tid % 32;
    unsigned slot;
    const lane_args *t;
    if (!cur) {
        fault("%s at %s:%d called outside a kernel", name, file, line);
        return nullptr;
    }
    slot = g_seq[w][l]++ & 1u;
    g_table[w][slot][l] = mine;
    warp_op(WARP_SYNC, 0xffffffffu, 0, 0, 32, file, line);
    t = g_table[w][slot];
    if (t[0].op != mine.op || t[0].ptr != mine.ptr || t[0].ldm != mine.ldm || t[0].layout != mine.layout)
        fault("%s at %s:%d: lane %d passes (%s, %p, ldm %u, layout %d) but lane 0 (%s, %p, ldm %u, layout %d); the arguments "
              "must be the same for the whole warp", name, file, line, l, op_name(mine.op), mine.ptr, mine.ldm, mine.layout,
              op_name(t[0].op), t[0].ptr, t[0].ldm, t[0].layout);
    if (mine.op != OP_MMA && l == 0) {
        if ((uintptr_t)mine.ptr % 32 != 0)
            fault("%s at %s:%d: pointer %p is not 256-bit aligned", name, file, line, mine.ptr);
        if ((mine.ldm * elem_bytes) % 16 != 0)
            fault("%s at %s:%d: ldm %u is not a multiple of 16 bytes (%zu-byte elements)", name, file, line, mine.ldm, elem_bytes);
    }
    return t;
}

void collective_end(const char *name, const char *file, int line) {
    (void)name;
    warp_op(WARP_SYNC, 0xffffffffu, 0, 0, 32, file, line);
}

} // namespace wmma_impl
} // namespace cuda_emu
