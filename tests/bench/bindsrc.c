/* LD_PRELOAD shim for load generators that cannot choose their source address (wrk,
 * h2load): every AF_INET TCP connect() first binds the socket to $BINDSRC_ADDR, port 0.
 * The terminate bench needs clients from several loopback addresses, because
 * `serve --workers N` picks a worker by the client's address.
 *
 *   cc -shared -fPIC -O2 -o bindsrc.so bindsrc.c -ldl
 *   LD_PRELOAD=./bindsrc.so BINDSRC_ADDR=127.0.0.2 wrk ...
 *
 * Without BINDSRC_ADDR it changes nothing. A bad address or a failing bind makes the
 * connect fail (errno from bind/inet_pton), so a misconfigured run cannot silently come
 * from 127.0.0.1. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static connect_fn real_connect;
    if (real_connect == NULL)
        real_connect = (connect_fn)dlsym(RTLD_NEXT, "connect");
    const char *src = getenv("BINDSRC_ADDR");
    if (src != NULL && *src != '\0' && addr != NULL && addr->sa_family == AF_INET) {
        int type = 0;
        socklen_t tlen = sizeof type;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) == 0 && type == SOCK_STREAM) {
            struct sockaddr_in me;
            memset(&me, 0, sizeof me);
            me.sin_family = AF_INET;
            me.sin_port = 0;
            if (inet_pton(AF_INET, src, &me.sin_addr) != 1) {
                errno = EINVAL;
                return -1;
            }
            /* Already bound (by the program itself) is fine: keep its choice. */
            if (bind(fd, (struct sockaddr *)&me, sizeof me) != 0 && errno != EINVAL)
                return -1;
        }
    }
    return real_connect(fd, addr, len);
}
