#include <errno.h>

#include <rte_mbuf_pool_ops.h>

#include "shim.h"

int sw_rte_errno(void) { return rte_errno; }

unsigned sw_lcore_id(void) { return rte_lcore_id(); }

uint16_t sw_eth_rx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n) {
    return rte_eth_rx_burst(port, queue, pkts, n);
}

uint16_t sw_eth_tx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n) {
    return rte_eth_tx_burst(port, queue, pkts, n);
}

struct rte_mempool *sw_pktmbuf_pool_create_packed(const char *name, unsigned n,
                                                  unsigned cache, uint16_t data_room,
                                                  int socket) {
    struct rte_pktmbuf_pool_private priv = {.mbuf_data_room_size = data_room,
                                            .mbuf_priv_size = 0};
    struct rte_mempool *mp =
        rte_mempool_create_empty(name, n, sizeof(struct rte_mbuf) + data_room, cache,
                                 sizeof(priv), socket, RTE_MEMPOOL_F_NO_IOVA_CONTIG);
    if (mp == NULL)
        return NULL;
    int ret = rte_mempool_set_ops_byname(mp, rte_mbuf_best_mempool_ops(), NULL);
    if (ret != 0) {
        rte_mempool_free(mp);
        rte_errno = -ret;
        return NULL;
    }
    rte_pktmbuf_pool_init(mp, &priv);
    ret = rte_mempool_populate_default(mp);
    if (ret < 0) {
        rte_mempool_free(mp);
        rte_errno = -ret;
        return NULL;
    }
    rte_mempool_obj_iter(mp, rte_pktmbuf_init, NULL);
    return mp;
}

struct rte_mbuf *sw_pktmbuf_alloc(struct rte_mempool *mp) { return rte_pktmbuf_alloc(mp); }

void sw_pktmbuf_free(struct rte_mbuf *m) { rte_pktmbuf_free(m); }

uint8_t *sw_pktmbuf_data(struct rte_mbuf *m) { return rte_pktmbuf_mtod(m, uint8_t *); }

uint16_t sw_pktmbuf_data_len(const struct rte_mbuf *m) { return rte_pktmbuf_data_len(m); }

uint16_t sw_pktmbuf_nb_segs(const struct rte_mbuf *m) { return m->nb_segs; }

uint16_t sw_pktmbuf_room(const struct rte_mbuf *m) { return (uint16_t)(m->buf_len - m->data_off); }

void sw_pktmbuf_set_len(struct rte_mbuf *m, uint16_t len) {
    m->data_len = len;
    m->pkt_len = len;
}

int sw_flow_udp_to_queue(uint16_t port, uint16_t udp_dst, uint16_t queue, int create,
                         struct rte_flow **flow, const char **msg) {
    struct rte_flow_attr attr = {.ingress = 1};
    struct rte_flow_item_udp spec = {.hdr.dst_port = rte_cpu_to_be_16(udp_dst)};
    struct rte_flow_item_udp mask = {.hdr.dst_port = RTE_BE16(0xffff)};
    struct rte_flow_item pattern[] = {
        {.type = RTE_FLOW_ITEM_TYPE_ETH},
        {.type = RTE_FLOW_ITEM_TYPE_IPV4},
        {.type = RTE_FLOW_ITEM_TYPE_UDP, .spec = &spec, .mask = &mask},
        {.type = RTE_FLOW_ITEM_TYPE_END},
    };
    struct rte_flow_action_queue to = {.index = queue};
    struct rte_flow_action actions[] = {
        {.type = RTE_FLOW_ACTION_TYPE_QUEUE, .conf = &to},
        {.type = RTE_FLOW_ACTION_TYPE_END},
    };
    struct rte_flow_error err = {0};
    *msg = NULL;
    if (!create) {
        int ret = rte_flow_validate(port, &attr, pattern, actions, &err);
        if (ret != 0)
            *msg = err.message;
        return ret;
    }
    *flow = rte_flow_create(port, &attr, pattern, actions, &err);
    if (*flow == NULL) {
        *msg = err.message;
        return rte_errno > 0 ? -rte_errno : -EINVAL;
    }
    return 0;
}

int sw_flow_destroy(uint16_t port, struct rte_flow *flow) {
    struct rte_flow_error err = {0};
    return rte_flow_destroy(port, flow, &err);
}
