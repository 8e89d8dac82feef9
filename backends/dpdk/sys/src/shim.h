/* What starwire-dpdk-sys binds: the DPDK headers it uses, and a C shim for
 * the functions DPDK defines `static inline` in its headers (the datapath:
 * rte_eth_rx_burst, rte_eth_tx_burst, mbuf allocation and access), which
 * have no symbol to link against. Each sw_ function is that call and
 * nothing more. */
#ifndef STARWIRE_DPDK_SHIM_H
#define STARWIRE_DPDK_SHIM_H

#include <stdint.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_flow.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

/* rte_errno of the calling thread. */
int sw_rte_errno(void);
/* rte_lcore_id(): the calling thread's lcore, LCORE_ID_ANY if none. */
unsigned sw_lcore_id(void);

uint16_t sw_eth_rx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n);
uint16_t sw_eth_tx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n);

/* rte_pktmbuf_pool_create with RTE_MEMPOOL_F_NO_IOVA_CONTIG: the objects
 * are laid end to end in one chunk, page boundaries or not (what
 * rte_pktmbuf_pool_create_by_ops does, with that flag). NULL and rte_errno
 * on failure. */
struct rte_mempool *sw_pktmbuf_pool_create_packed(const char *name, unsigned n,
                                                  unsigned cache, uint16_t data_room,
                                                  int socket);

/* rte_pktmbuf_alloc: NULL when the pool is empty. */
struct rte_mbuf *sw_pktmbuf_alloc(struct rte_mempool *mp);
/* rte_pktmbuf_free: the whole chain back to its pool. */
void sw_pktmbuf_free(struct rte_mbuf *m);
/* rte_pktmbuf_mtod: the first byte of the first segment's data. */
uint8_t *sw_pktmbuf_data(struct rte_mbuf *m);
/* data_len of the first segment. */
uint16_t sw_pktmbuf_data_len(const struct rte_mbuf *m);
/* Segments in the chain. */
uint16_t sw_pktmbuf_nb_segs(const struct rte_mbuf *m);
/* Room from the data's start to the end of the first segment's buffer. */
uint16_t sw_pktmbuf_room(const struct rte_mbuf *m);
/* A one-segment packet of len bytes: data_len = pkt_len = len. */
void sw_pktmbuf_set_len(struct rte_mbuf *m, uint16_t len);

/* Validate (create == 0) or create (create != 0) an ingress rule that sends
 * Ethernet/IPv4/UDP packets to UDP port udp_dst to receive queue queue
 * (rte_flow_validate / rte_flow_create). Returns 0, or a negative errno with
 * *msg set to the driver's static message (or NULL); on creation *flow
 * is the rule. */
int sw_flow_udp_to_queue(uint16_t port, uint16_t udp_dst, uint16_t queue, int create,
                         struct rte_flow **flow, const char **msg);
/* rte_flow_destroy: 0 or a negative errno. */
int sw_flow_destroy(uint16_t port, struct rte_flow *flow);

#endif
