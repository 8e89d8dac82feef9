#include "shim.h"

int sw_rte_errno(void) { return rte_errno; }

unsigned sw_lcore_id(void) { return rte_lcore_id(); }

uint16_t sw_eth_rx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n) {
    return rte_eth_rx_burst(port, queue, pkts, n);
}

uint16_t sw_eth_tx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n) {
    return rte_eth_tx_burst(port, queue, pkts, n);
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
