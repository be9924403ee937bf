//! Group handshake: connect to every rank of a remote engine at once and
//! reach one uniform verdict within one deadline.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::config::RemoteInfo;
use crate::error::{GroupError, RankFailure};
use crate::ids::ConnectionId;
use crate::ids::Ranks;
use crate::peer::Event;

#[derive(Debug, Clone)]
enum Slot {
    Pending,
    Ready(RemoteInfo),
    Failed(String),
}

#[derive(Debug, Clone)]
struct Member {
    ranks: Ranks,
    addr: String,
    id: Option<ConnectionId>,
    slot: Slot,
}

/// Collects the result of every rank; the verdict is all ready, or a
/// [`GroupError`] naming every failing rank with its own cause.
#[derive(Debug, Clone)]
pub struct GroupHandshake {
    host: String,
    deadline: Instant,
    members: Vec<Member>,
}

/// One rank of a successful group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupMember {
    /// Expected ranks.
    pub ranks: Ranks,
    /// Address dialed.
    pub addr: String,
    /// Connection id.
    pub id: ConnectionId,
    /// What the rank told us.
    pub remote: RemoteInfo,
}

impl GroupHandshake {
    /// A collector for `host`, ending at `deadline`.
    pub fn new(host: impl Into<String>, deadline: Instant) -> Self {
        Self {
            host: host.into(),
            deadline,
            members: Vec::new(),
        }
    }

    /// Adds a rank dialed as `id` (or that failed to dial: `Err(cause)`).
    pub fn expect(&mut self, ranks: Ranks, addr: String, id: Result<ConnectionId, String>) {
        let (id, slot) = match id {
            Ok(id) => (Some(id), Slot::Pending),
            Err(cause) => (None, Slot::Failed(cause)),
        };
        self.members.push(Member {
            ranks,
            addr,
            id,
            slot,
        });
    }

    /// Feeds one peer event.
    pub fn handle_event(&mut self, id: ConnectionId, event: &Event) {
        let Some(m) = self.members.iter_mut().find(|m| m.id == Some(id)) else {
            return;
        };
        if !matches!(m.slot, Slot::Pending) {
            return;
        }
        m.slot = match event {
            Event::Ready(info)
                if info.identity.dp_rank != m.ranks.dp_rank
                    || info.identity.tp_rank != m.ranks.tp_rank =>
            {
                Slot::Failed(format!(
                    "peer reports dp_rank {} tp_rank {}, expected dp_rank {} tp_rank {}",
                    info.identity.dp_rank, info.identity.tp_rank, m.ranks.dp_rank, m.ranks.tp_rank
                ))
            }
            Event::Ready(info) => Slot::Ready(info.clone()),
            Event::Refused { refusal, .. } => Slot::Failed(format!("refused: {refusal}")),
            Event::Dead {
                attempts,
                last_error,
                ..
            } => Slot::Failed(format!("dead after {attempts} attempts: {last_error}")),
            Event::Closed => Slot::Failed("closed".into()),
            _ => return,
        };
    }

    /// Marks every pending rank as timed out once `now` reaches the deadline.
    pub fn handle_timeout(&mut self, now: Instant) {
        if now >= self.deadline {
            for m in &mut self.members {
                if matches!(m.slot, Slot::Pending) {
                    m.slot = Slot::Failed("no handshake before the group deadline".into());
                }
            }
        }
    }

    /// The group deadline.
    #[must_use]
    pub fn poll_timeout(&self) -> Instant {
        self.deadline
    }

    /// Connection ids to close when the verdict is a failure.
    pub fn ids(&self) -> Vec<ConnectionId> {
        self.members.iter().filter_map(|m| m.id).collect()
    }

    /// The verdict, once every rank has one.
    #[must_use]
    pub fn poll_outcome(&self) -> Option<Result<Vec<GroupMember>, GroupError>> {
        if self.members.iter().any(|m| matches!(m.slot, Slot::Pending)) {
            return None;
        }
        let failures: Vec<RankFailure> = self
            .members
            .iter()
            .filter_map(|m| match &m.slot {
                Slot::Failed(cause) => Some(RankFailure {
                    ranks: m.ranks,
                    addr: m.addr.clone(),
                    cause: cause.clone(),
                }),
                _ => None,
            })
            .collect();
        if !failures.is_empty() {
            return Some(Err(GroupError::RanksFailed {
                host: self.host.clone(),
                total: self.members.len(),
                failures,
            }));
        }
        let mut ok = BTreeMap::new();
        for m in &self.members {
            if let (Slot::Ready(info), Some(id)) = (&m.slot, m.id) {
                ok.insert(
                    (m.ranks.dp_rank, m.ranks.tp_rank),
                    GroupMember {
                        ranks: m.ranks,
                        addr: m.addr.clone(),
                        id,
                        remote: info.clone(),
                    },
                );
            }
        }
        Some(Ok(ok.into_values().collect()))
    }
}
