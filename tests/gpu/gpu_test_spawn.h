/* gpu_test_spawn.h - how the multi-rank GPU tests start their ranks: the test program runs
   itself again as `world` local ranks with `--rank-child part` (dsk_comm_spawn_local) on a
   fresh port whose successor is free too (nccl's store takes the port, the host communicator
   the next), and checks that every rank exited with status 0. Each rank opens an nccl and a
   host communicator and a context on its device with gpu_test_rank_open. Include after
   dsk_comm.h and tests/dsk_test.h. */
#ifndef DSK_GPU_TEST_SPAWN_H
#define DSK_GPU_TEST_SPAWN_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#ifdef DSK_CUDA /* what the GPU cases call besides the API and the launchers (dsk_cuda_*): the runtime */
#include <cuda_runtime.h>
#endif

/* A free port on 127.0.0.1 whose successor is free as well; 0 if none was found. */
static inline int gpu_test_port_pair(void) {
    int port = 0;
    for (int tries = 0; tries < 50; tries++) {
        struct sockaddr_in sa;
        int fd, ok;
        if (dsk_comm_free_port("127.0.0.1", &port) != DSK_OK) return 0;
        fd = socket(AF_INET, SOCK_STREAM, 0);
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        sa.sin_port = htons((uint16_t)(port + 1));
        ok = fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
        if (fd >= 0) close(fd);
        if (ok) return port;
    }
    return port;
}

/* Runs this program as `world` ranks of `--rank-child part`; a failed start or a rank that
   exits non-zero fails the current case. */
static inline void gpu_test_spawn_self(int world, const char *part) {
    char self[4096], *av[] = {self, (char *)"--rank-child", (char *)part, NULL};
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    dsk_comm_spawn_opts so;
    int worst = -1;
    self[k > 0 ? k : 0] = 0;
    memset(&so, 0, sizeof so);
    so.master_port = gpu_test_port_pair();
    so.timeout_s = 300;
    fflush(stdout);
    DSK_TEST_OK(dsk_comm_spawn_local(world, av, &so, &worst));
    DSK_TEST_EXPECT(worst == 0, "ranks exited with status %d", worst);
}

/* In a rank: nc over nccl from the launcher's environment, hc over the host backend on the
   next port, g on the rank's local device; host_id (NULL: the machine's) names the emulated
   host of both. 0, or 3 after printing what failed. */
static inline int gpu_test_rank_open(dsk_comm *nc, dsk_comm *hc, dsk_ctx *g, const char *host_id) {
    dsk_comm_opts o;
    dsk_ctx_opts co;
    const char *port = getenv("MASTER_PORT");
    memset(&o, 0, sizeof o);
    o.backend = DSK_COMM_NCCL;
    o.timeout_s = 120;
    o.host_id = host_id;
    if (dsk_comm_init_env(nc, &o) != DSK_OK) { printf("nccl init: %s\n", dsk_last_error()); return 3; }
    if (nc->cuda_device != nc->local_rank) { /* one device per rank here */
        printf("nccl: cuda_device %d, want the local rank %d\n", nc->cuda_device, nc->local_rank);
        return 3;
    }
    o.backend = DSK_COMM_HOST;
    o.master_addr = "127.0.0.1";
    o.master_port = atoi(port ? port : "0") + 1;
    if (dsk_comm_init(hc, nc->rank, nc->world_size, &o) != DSK_OK) {
        printf("host init: %s\n", dsk_last_error());
        return 3;
    }
    if (hc->cuda_device != -1) {
        printf("host: cuda_device %d, want -1\n", hc->cuda_device);
        return 3;
    }
    memset(&co, 0, sizeof co);
    co.device = DSK_PREFER_CUDA;
    co.cuda_index = nc->cuda_device;
    if (dsk_ctx_init(g, &co) != DSK_OK) { printf("ctx: %s\n", dsk_last_error()); return 3; }
    return 0;
}

/* Closes what gpu_test_rank_open opened; the rank's exit status (1 if a check failed). */
static inline int gpu_test_rank_close(dsk_comm *nc, dsk_comm *hc, dsk_ctx *g) {
    dsk_ctx_free(g);
    dsk_comm_free(hc);
    dsk_comm_free(nc);
    return dsk_test_g.checks_failed_total ? 1 : 0;
}

#endif /* DSK_GPU_TEST_SPAWN_H */
