//! What the control socket reports: the stream table behind `smc ss`, link groups, devices,
//! statistics.

use super::*;

fn mode_text(e: &StreamEntry) -> (String, Option<String>, Option<u32>) {
    match e.fallback {
        Some(r) => (
            "TCP".into(),
            Some(r.to_string()),
            r.decline_code().map(|c| c.0),
        ),
        None => ("SMC-R".into(), None, None),
    }
}

impl Stack {
    /// Register an open stream for `smc ss`; returns its registration number.
    pub(crate) fn register_stream(&self, e: StreamEntry) -> u64 {
        let mut core = self.inner.lock();
        let id = core.next_stream;
        core.next_stream += 1;
        core.streams.insert(id, e);
        id
    }

    /// Forget a stream registered with [`register_stream`](Self::register_stream).
    pub(crate) fn unregister_stream(&self, id: u64) {
        self.inner.lock().streams.remove(&id);
    }

    /// `ss`: every open socket with its mode, state and counters.
    pub(crate) fn query_ss(&self) -> serde_json::Value {
        let core = self.inner.lock();
        let rows: Vec<serde_json::Value> = core
            .streams
            .values()
            .map(|e| {
                let (mode, reason, code) = mode_text(e);
                let conn = e.smc.and_then(|t| core.ep.connection(t));
                let link = e.smc.and_then(|t| core.ep.connection_link(t));
                // The GIDs of the link the connection sends on (ours, the peer's).
                let l = link.and_then(|(g, n)| core.ep.link_group(g)?.links.get(&n));
                let gid = l
                    .and_then(|l| core.fab.ports.get(usize::from(l.device.0)))
                    .map(|p| p.gid.to_string());
                let peer_gid = l
                    .and_then(|l| l.remote)
                    .map(|r| smc_fabric::Gid(r.gid.0).to_string());
                serde_json::json!({
                    "local": e.local.map(|a| a.to_string()),
                    "peer": e.peer.map(|a| a.to_string()),
                    "role": if e.server { "server" } else { "client" },
                    "mode": mode,
                    "fallback_reason": reason,
                    "decline_code": code,
                    "state": conn.map(|c| c.state().to_string()),
                    "link_group": link.map(|l| l.0 .0),
                    "send_link": link.map(|l| l.1),
                    "gid": gid,
                    "peer_gid": peer_gid,
                    "bytes_sent": conn.map(|c| c.stats().bytes_produced),
                    "bytes_received": conn.map(|c| c.stats().bytes_received),
                    "rmbe_size": conn.map(|c| c.config().local_rmbe_len),
                    "peer_rmbe_size": conn.map(|c| c.config().peer_rmbe_len),
                    "producer_cursor": conn.map(|c| c.producer_cursor().to_string()),
                    "consumer_cursor": conn.map(|c| c.consumer_cursor().to_string()),
                    "peer_producer_cursor": conn.map(|c| c.peer_producer_cursor().to_string()),
                    "peer_consumer_cursor": conn.map(|c| c.peer_consumer_cursor().to_string()),
                    "send_window": conn.map(|c| c.window()),
                    "readable": conn.map(|c| c.readable()),
                })
            })
            .collect();
        serde_json::Value::Array(rows)
    }

    /// `linkgroup`: link groups and links.
    pub(crate) fn query_linkgroups(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.link_groups()
                .into_iter()
                .map(|g| {
                    serde_json::json!({
                        "id": g.id,
                        "role": if g.server { "server" } else { "client" },
                        "version": g.version,
                        "peer": g.peer,
                        "connections": g.connections,
                        "links": g.links.iter().map(|l| serde_json::json!({
                            "num": l.num,
                            "device": l.device,
                            "gid": l.gid,
                            "peer_gid": l.peer_gid,
                            "state": if l.active { "active" } else { "activating" },
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect(),
        )
    }

    /// `device`: the stack's RNICs.
    pub(crate) fn query_devices(&self) -> serde_json::Value {
        let core = self.inner.lock();
        serde_json::Value::Array(
            core.fab
                .devices
                .iter()
                .map(|d| {
                    let mut v = serde_json::json!({
                        "name": d.name(),
                        "kind": d.kind().label(),
                        "netdev": d.netdev(),
                        "gid": d.gid().to_string(),
                        "gids": d.gids().iter().map(|g| g.to_string()).collect::<Vec<_>>(),
                        "mac": d.mac().to_string(),
                        "mtu": d.active_mtu().bytes(),
                        "netdev_mtu": d.netdev_mtu(),
                        "port": match d.port_state() {
                            PortState::Active => "active",
                            PortState::Down => "down",
                        },
                        "netdevs": d.config().netdevs,
                        "addresses": d.config().addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
                    });
                    if let Some(c) = d.counters() {
                        v["counters"] = serde_json::json!({
                            "tx_packets": c.tx_packets,
                            "rx_packets": c.rx_packets,
                            "tx_bytes": c.tx_bytes,
                            "rx_bytes": c.rx_bytes,
                            "retransmits": c.retransmits,
                            "timeouts": c.timeouts,
                            "acks_sent": c.acks_sent,
                            "naks_sent": c.naks_sent,
                            "naks_received": c.naks_received,
                            "rnr_naks_sent": c.rnr_naks_sent,
                            "rnr_naks_received": c.rnr_naks_received,
                            "duplicates": c.duplicates,
                            "drop_icrc": c.drop_icrc,
                            "drop_malformed": c.drop_malformed,
                            "drop_unknown_qp": c.drop_unknown_qp,
                            "drop_wrong_source": c.drop_wrong_source,
                            "drop_out_of_sequence": c.drop_out_of_sequence,
                            "drop_ghost_acks": c.drop_ghost_acks,
                            "remote_access_errors": c.remote_access_errors,
                            "tx_errors": c.tx_errors,
                            "fault_drops": c.fault_drops,
                        });
                    }
                    v
                })
                .collect(),
        )
    }

    /// The protocol endpoint's counters (LLC, failover, refused peer RMBs).
    pub fn endpoint_stats(&self) -> smc_proto::endpoint::EndpointStats {
        self.inner.lock().ep.stats()
    }

    /// `stats`: the stack's and the endpoint's counters and fallbacks by reason.
    pub(crate) fn query_stats(&self) -> serde_json::Value {
        let core = self.inner.lock();
        let s = core.stats;
        let e = core.ep.stats();
        serde_json::json!({
            "peer_id": format!("{:04x}@{}", self.inner.peer_id.instance, self.inner.peer_id.mac),
            "discovery": format!("{:?}", self.discovery_mode()),
            "smc_connections": s.smc,
            "fallbacks": s.fallbacks,
            "fallbacks_by_reason": core.fallback_reasons,
            "setup_resets": s.setup_resets,
            "links_up": s.links_up,
            "tcp_resets": s.tcp_resets,
            "tcp_data_aborts": s.tcp_data_aborts,
            "bytes_kept_at_reset": s.bytes_kept_at_reset,
            "ended_by_peer_exit": s.ended_by_peer_exit,
            "links_down": s.links_down,
            "failovers": e.failovers,
            "link_failures": e.link_failures,
            "llc_discarded": e.llc_discarded,
            "peer_rmbs_refused": e.rkeys_refused,
            "llc_v2_add_link_invalid": e.llc_v2_add_link_invalid,
            "test_links_sent": e.test_links_sent,
            "open_sockets": core.streams.len(),
        })
    }
}

/// A link of a link group, for display.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// Link number in the group.
    pub num: u8,
    /// Our device name.
    pub device: String,
    /// Our GID on the link (one of the device's, `smc device` lists them).
    pub gid: String,
    /// The peer's GID on the link, once known.
    pub peer_gid: Option<String>,
    /// Whether the link is confirmed and carries traffic.
    pub active: bool,
}

/// A link group, for display.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkGroupInfo {
    /// Endpoint-local id.
    pub id: u32,
    /// Whether we are the server of the group.
    pub server: bool,
    /// The peer's ID.
    pub peer: String,
    /// Links.
    pub links: Vec<LinkInfo>,
    /// Connections on the group.
    pub connections: usize,
    /// The SMC-R version the group speaks: 1, or 2 for an SMC-Rv2 group (docs/v2.md).
    pub version: u8,
}

impl Stack {
    /// Counters.
    pub fn stats(&self) -> StackStats {
        self.inner.lock().stats
    }

    /// Names of the stack's devices.
    pub fn devices(&self) -> Vec<String> {
        self.inner
            .lock()
            .fab
            .devices
            .iter()
            .map(|d| d.name().to_string())
            .collect()
    }

    /// Fault injection: bring device `name`'s port down or up (links on it fail over).
    pub fn set_port_state(&self, name: &str, state: PortState) -> bool {
        let core = self.inner.lock();
        match core.fab.devices.iter().find(|d| d.name() == name) {
            Some(d) => {
                d.set_port_state(state);
                true
            }
            None => false,
        }
    }

    /// Fault injection: move the QP of link `link` of link group `group` (ids as
    /// [`link_groups`](Self::link_groups) shows them) to the error state, as an RNIC does on a
    /// fatal QP error: its connections fail over, the peer's QP fails too. Returns whether
    /// such a link exists.
    pub fn fail_link(&self, group: u32, link: u8) -> bool {
        let core = self.inner.lock();
        let id = core
            .ep
            .link_groups()
            .find(|g| g.id.0 == group)
            .and_then(|g| g.links.get(&link))
            .map(|l| l.id);
        match id.and_then(|id| core.fab.links.get(&id)) {
            Some(l) => {
                l.qp.force_error();
                true
            }
            None => false,
        }
    }

    /// The link groups with their links.
    pub fn link_groups(&self) -> Vec<LinkGroupInfo> {
        let core = self.inner.lock();
        core.ep
            .link_groups()
            .map(|g| LinkGroupInfo {
                id: g.id.0,
                server: matches!(g.role, smc_proto::link_group::Role::Server),
                peer: format!("{:04x}@{}", g.peer_id.instance, g.peer_id.mac),
                links: g
                    .links
                    .values()
                    .map(|l| LinkInfo {
                        num: l.num,
                        device: core
                            .fab
                            .port_device(l.device)
                            .map(|d| d.name().to_string())
                            .unwrap_or_default(),
                        gid: core
                            .fab
                            .ports
                            .get(usize::from(l.device.0))
                            .map(|p| p.gid.to_string())
                            .unwrap_or_default(),
                        peer_gid: l.remote.map(|r| smc_fabric::Gid(r.gid.0).to_string()),
                        active: matches!(l.state, smc_proto::link_group::LinkState::Active),
                    })
                    .collect(),
                connections: g.conns.len(),
                version: if g.v2.is_some() { 2 } else { 1 },
            })
            .collect()
    }
}
