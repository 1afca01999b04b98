/* gpu_test_spawn.h - how the multi-rank GPU tests start their ranks: the test program runs
   itself again as `world` local ranks with `--rank-child part` (dsk_comm_spawn_local) on a
   fresh port whose successor is free too (nccl's store takes the port, the host communicator
   the next), and checks that every rank exited with status 0. Include after dsk_comm.h and
   tests/dsk_test.h. */
#ifndef DSK_GPU_TEST_SPAWN_H
#define DSK_GPU_TEST_SPAWN_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

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

#endif /* DSK_GPU_TEST_SPAWN_H */
