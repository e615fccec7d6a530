//! [`LockTable`]: the deterministic state machine every replica applies committed batches to.

use std::collections::{BTreeSet, VecDeque};

use imbl::{OrdMap, OrdSet};

use serde::{Deserialize, Serialize};

use crate::FencingToken;
use crate::command::{
    Batch, Command, EndWaitReason, Event, EventKind, Grant, Limit, Outcome, Stamp,
};
use crate::keys::SigningKeys;
use crate::limits::{ACTIVE_RESOURCES_MAX, DEDUP_RECORDS_MAX, Policy};
use crate::types::{LeaseId, RequestKey, ResourceName, shown_request_id};

/// The replicated lock table. Changed only by [`LockTable::apply`]; everything else reads.
///
/// The large collections are persistent (imbl; the dedup window's records in shared chunks): a
/// snapshot copy ([`LockTable::snapshot_copy`]) shares structure, copying at most one pointer per
/// 244 records, so a snapshot is consistent without stopping apply for the length of
/// a deep copy; later writes copy only the nodes they touch. Ordered collections throughout (the dedup
/// window's hash index is only looked up, never iterated), so every replica iterates and encodes
/// the same table identically.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LockTable {
    /// Resources that have a holder or waiters; idle records are deleted, so the table holds
    /// active resources only. An ordered map so that any iteration is the same on every replica.
    resources: OrdMap<ResourceName, ResourceState>,
    /// (expires_at_ms, resource) of every lease, so the leader's reaper reads due leases from the
    /// front instead of scanning the table.
    expiries: OrdSet<(i64, ResourceName)>,
    /// (deadline_ms, resource, waiter) of every waiter, for the same reason.
    wait_deadlines: OrdSet<(i64, ResourceName, RequestKey)>,
    /// Outcome of every recent Acquire by request key, so a retry returns the original outcome.
    dedup: DedupWindow,
    /// Waiters queued per tenant (the resource name before its first `/`).
    tenant_waiters: OrdMap<String, u32>,
    /// Active resources (entries of `resources`) per tenant, for the per-tenant quota.
    tenant_resources: OrdMap<String, u32>,
    /// Live dedup records per tenant tag (records with tag 0, made before tags, are not
    /// counted), for the per-tenant quota.
    tenant_records: OrdMap<u64, u32>,
    /// The last fencing token issued. Tokens come from this counter only, and the counter is
    /// part of the replicated state and the snapshots, so it never repeats or goes back.
    last_token: u64,
    /// The table's clock, in ms (see the clock rule on [`LockTable::apply`]). Roughly Unix ms:
    /// it starts at the first leader's wall clock and then lags real time by the failover
    /// pauses, so times derived from it (`expires_at_ms`) are informative only.
    now_ms: i64,
    /// The Raft term of the last batch applied; a larger one starts a new term (see
    /// `begin_term`).
    term: u64,
    /// Which leader process's monotonic clock drives `now_ms`, and where the two clocks were
    /// lined up. `None` until the first stamped batch.
    anchor: Option<ClockAnchor>,
    /// Key of the keyed digests (request keys, argument digests, tenant tags): the
    /// `Stamp::key_seed` of the first stamped batch this table applied, so every replica has
    /// the same key and no client knows it. `None` before (legacy entries only), when the
    /// unkeyed hashes of older lockd are used.
    secret: Option<u128>,
    /// Queued requests whose call was cancelled: they keep their place, so a retry of the same
    /// request_id takes it back, but are never granted (hand-off skips and drops them) and are
    /// not counted in positions or `Describe`. Dropped at their deadline too.
    abandoned: OrdSet<RequestKey>,
    /// Number of held leases and of queued waiters, kept so Status is O(1).
    held: u64,
    waiting: u64,
    /// The sequencer signing keys (see [`crate::keys`]). Not part of the table's own encoding:
    /// snapshot format 4 appends them after it, so format-3 tables still decode (with no keys).
    #[serde(skip)]
    keys: SigningKeys,
}

/// The table's clock was at `table_ms` when the process `session` (stamping in `term`) read
/// `mono_ms` on its monotonic clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockAnchor {
    /// The Raft term of the stamping leader.
    pub term: u64,
    /// The stamping process (random per process start).
    pub session: u64,
    /// That process's monotonic clock reading, in ms.
    pub mono_ms: u64,
    /// The table's clock at that reading, in ms.
    pub table_ms: i64,
}

impl ClockAnchor {
    /// The table time `mono_ms` of the anchored session corresponds to (never before the
    /// anchor).
    fn table_time(&self, mono_ms: u64) -> i64 {
        let delta = mono_ms.saturating_sub(self.mono_ms).min(i64::MAX as u64) as i64;
        self.table_ms.saturating_add(delta)
    }
}

/// One resource's holder and queue.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct ResourceState {
    lease: Option<Lease>,
    /// FIFO: the front is served next.
    waiters: VecDeque<Waiter>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Lease {
    id: LeaseId,
    token: FencingToken,
    holder: String,
    request_id: String,
    lease_ttl_ms: u64,
    expires_at_ms: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Waiter {
    key: RequestKey,
    request_id: String,
    /// The lease id the leader drew when the waiter queued; used if it is granted.
    lease_id: LeaseId,
    holder: String,
    lease_ttl_ms: u64,
    deadline_ms: i64,
}

/// What Describe shows of one resource. Never contains the lease id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceView {
    /// Whether a lease holds the resource now.
    pub held: bool,
    /// The lease's holder name (empty when not held).
    pub holder: String,
    /// The lease's fencing token (0 when not held).
    pub fencing_token: FencingToken,
    /// When the lease expires unless renewed, by the table's clock (0 when not held).
    pub expires_at_ms: i64,
    /// Waiters queued for the resource, not counting those whose caller went away.
    pub waiters: u32,
}

/// Table-wide counters for Status and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Resources held by a lease.
    pub active_locks: u64,
    /// Waiters queued, over all resources.
    pub waiters: u64,
    /// Resources the table tracks (held or with waiters).
    pub resources: u64,
    /// request_id records kept for deduplication.
    pub dedup_records: u64,
    /// The last fencing token issued.
    pub last_token: u64,
    /// The table's clock, in ms (roughly Unix ms).
    pub now_ms: i64,
    /// The Raft term of the last batch applied.
    pub term: u64,
}

impl LockTable {
    /// An empty table, as a new cluster starts with.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one committed batch from a Raft entry of `term`, returning one outcome per command
    /// in order and appending the resulting state changes to `events`.
    ///
    /// Clock rule (INV-CLOCK-MONOTONIC-DELTA): the table's clock advances only by differences
    /// of two monotonic readings of one leader process, so it never runs faster than real time
    /// and no wall-clock offset, of any size, moves it:
    /// - a stamp of the anchored session moves the clock to `anchor.table_ms + (mono_ms -
    ///   anchor.mono_ms)` if that is later;
    /// - a stamp of another session (a new leader, or the same node restarted, possibly in the
    ///   same term) with a term at least the anchor's re-anchors at the current table time: the
    ///   clock pauses over the failover, so leases only end later in real time, never earlier;
    /// - a stamp of an older term than the anchor's (stamped before a leadership change, committed
    ///   after it) never moves the clock;
    /// - the very first stamp of an empty table sets the clock to the leader's wall clock.
    ///
    /// The stamp's term is capped at the entry's term, so a bad stamp cannot claim a future term
    /// and freeze the clock for the real leaders that follow.
    pub fn apply(&mut self, term: u64, batch: &Batch, events: &mut Vec<Event>) -> Vec<Outcome> {
        match batch.stamp {
            Some(stamp) => {
                if self.secret.is_none() {
                    self.secret = Some(stamp.key_seed);
                }
                self.advance_clock(term, batch.now_ms, stamp);
                self.term = self.term.max(term);
            }
            None => {
                // Legacy entry (written before stamps): its wall-clock stamp is the clock.
                // INV-TIME-MONOTONIC: a new leader whose clock is behind cannot move time back.
                self.now_ms = self.now_ms.max(batch.now_ms);
                if term > self.term {
                    self.begin_term(term);
                }
            }
        }
        self.prune_dedup(&batch.policy);
        batch
            .commands
            .iter()
            .map(|cmd| self.apply_command(cmd, &batch.policy, events))
            .collect()
    }

    /// See the clock rule on [`LockTable::apply`].
    fn advance_clock(&mut self, entry_term: u64, wall_ms: i64, stamp: Stamp) {
        let term = stamp.term.min(entry_term);
        let fresh = |table_ms| ClockAnchor {
            term,
            session: stamp.session,
            mono_ms: stamp.mono_ms,
            table_ms,
        };
        match self.anchor {
            None if self.now_ms == 0 && self.last_token == 0 && self.resources.is_empty() => {
                // An empty table: start near Unix time so expiry times read as dates.
                self.now_ms = wall_ms.max(0);
                self.anchor = Some(fresh(self.now_ms));
            }
            None => self.anchor = Some(fresh(self.now_ms)),
            Some(anchor) if term < anchor.term => {}
            Some(mut anchor) if anchor.session == stamp.session => {
                self.now_ms = self.now_ms.max(anchor.table_time(stamp.mono_ms));
                anchor.term = term;
                self.anchor = Some(anchor);
            }
            Some(_) => self.anchor = Some(fresh(self.now_ms)),
        }
    }

    /// INV-CONSERVATIVE-FAILOVER, for legacy (unstamped) entries only: the first such batch of
    /// a new term extends every lease to at least (its stamp + the lease's ttl). Those stamps
    /// are wall clocks of different nodes, so a new leader ahead of the old one would otherwise
    /// expire leases early. Stamped batches need no extension: their clock never runs faster
    /// than real time (see [`LockTable::apply`]) and pauses over a failover, which already
    /// keeps every lease at least as long as its holder counts.
    fn begin_term(&mut self, term: u64) {
        self.term = term;
        self.extend_leases_to_full_ttl();
    }

    /// Makes every lease end no earlier than the table's time plus its ttl (a new legacy term,
    /// and a restore from a backup); returns how many leases it extended.
    fn extend_leases_to_full_ttl(&mut self) -> u64 {
        let now = self.now_ms;
        let short: Vec<(ResourceName, i64, i64)> = self
            .resources
            .iter()
            .filter_map(|(name, state)| {
                let lease = state.lease.as_ref()?;
                let floor = now.saturating_add(lease.lease_ttl_ms as i64);
                (lease.expires_at_ms < floor).then(|| (name.clone(), lease.expires_at_ms, floor))
            })
            .collect();
        let extended = short.len() as u64;
        for (name, old, floor) in short {
            if let Some(lease) = self.resources.get_mut(&name).and_then(|s| s.lease.as_mut()) {
                lease.expires_at_ms = floor;
            }
            self.expiries.remove(&(old, name.clone()));
            self.expiries.insert((floor, name));
        }
        extended
    }

    fn apply_command(
        &mut self,
        cmd: &Command,
        policy: &Policy,
        events: &mut Vec<Event>,
    ) -> Outcome {
        match cmd {
            Command::Acquire {
                resource,
                request_id,
                lease_ttl_ms,
                wait_timeout_ms,
                holder,
                lease_id,
            }
            | Command::AcquireV2 {
                resource,
                request_id,
                lease_ttl_ms,
                wait_timeout_ms,
                holder,
                lease_id,
            } => self.acquire(
                AcquireArgs {
                    resource,
                    request_id,
                    lease_ttl_ms: *lease_ttl_ms,
                    wait_timeout_ms: *wait_timeout_ms,
                    holder,
                    lease_id: *lease_id,
                    record_held: matches!(cmd, Command::AcquireV2 { .. }),
                },
                policy,
                events,
            ),
            Command::Renew {
                resource,
                lease_id,
                lease_ttl_ms,
            } => self.renew(resource, *lease_id, *lease_ttl_ms, events),
            Command::Release { resource, lease_id } => self.release(resource, *lease_id, events),
            Command::Reap { resource } => {
                self.settle(resource, events);
                Outcome::Reaped
            }
            Command::EndWait {
                resource,
                request_id,
                reason,
            } => self.end_wait(resource, request_id, *reason, None, events),
            Command::EndWaitAttempt {
                resource,
                request_id,
                reason,
                attempt,
            } => self.end_wait(resource, request_id, *reason, Some(*attempt), events),
            Command::InstallSigningKey { pkcs8, replaces } => {
                match self.keys.install(pkcs8, *replaces, self.now_ms) {
                    Ok(id) => Outcome::SigningKeyInstalled { key_id: id.0 },
                    Err(why) => Outcome::SigningKeyRefused(why),
                }
            }
        }
    }

    fn acquire(
        &mut self,
        args: AcquireArgs<'_>,
        policy: &Policy,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let AcquireArgs {
            resource,
            request_id,
            lease_ttl_ms,
            wait_timeout_ms,
            holder,
            lease_id,
            record_held,
        } = args;
        let ident = self.ident(request_id, resource, lease_ttl_ms, wait_timeout_ms, holder);
        let key = ident.key;
        self.settle(resource, events);

        // INV-DEDUP: a retry answers from the record, never acts again.
        if let Some((recorded, state)) = self.lookup(request_id) {
            if !self.same_args(
                &recorded,
                &ident,
                resource,
                lease_ttl_ms,
                wait_timeout_ms,
                holder,
            ) {
                return Outcome::InvalidArgument(format!(
                    "invalid request_id: {} was already used with other arguments \
                     (resource, lease_ttl_ms, wait_timeout_ms or holder); use a new request_id \
                     for a new attempt",
                    shown_request_id(request_id)
                ));
            }
            return match state {
                DedupState::Granted(grant) => Outcome::Granted(self.refresh(resource, grant)),
                DedupState::TimedOut => Outcome::WaitTimedOut,
                // The first answer stands, whoever holds the resource now (empty: nobody).
                DedupState::Held => Outcome::Held {
                    holder: self
                        .resources
                        .get(resource)
                        .and_then(|s| s.lease.as_ref())
                        .map(|l| l.holder.clone())
                        .unwrap_or_default(),
                },
                DedupState::Waiting => {
                    match self.reattach(resource, recorded.key, request_id, lease_id) {
                        Some(position) => Outcome::Queued { position },
                        // Only a digest collision with a request queued elsewhere gets here: answer
                        // the client, never stop the replica (INV-NO-CLIENT-PANIC).
                        None => Outcome::InvalidArgument(format!(
                            "invalid request_id: {} matches a request queued on another \
                         resource than {resource:?}; use a new request_id",
                            shown_request_id(request_id)
                        )),
                    }
                }
            };
        }

        if self.dedup.len() >= DEDUP_RECORDS_MAX {
            return Outcome::Exhausted(
                Limit::DedupRecords,
                format!(
                    "request dedup table is full ({DEDUP_RECORDS_MAX} records within the retention \
                 window): too many acquires"
                ),
            );
        }
        // Per-tenant quotas (INV-TENANT-QUOTA): one tenant's flood cannot use up the
        // table-wide bounds above for everybody else.
        let records = self.tenant_records.get(&ident.tenant).copied().unwrap_or(0);
        if ident.tenant != 0 && records >= policy.dedup_records_per_tenant_max {
            return Outcome::Exhausted(
                Limit::DedupRecordsPerTenant,
                format!(
                    "tenant {:?} has {records} acquires within the request_id retention window: \
                 limit dedup_records_per_tenant_max is {}",
                    resource.tenant(),
                    policy.dedup_records_per_tenant_max
                ),
            );
        }
        let tenant_active = self
            .tenant_resources
            .get(resource.tenant())
            .copied()
            .unwrap_or(0);
        let mut state = match self.take(resource) {
            Some(state) => state,
            None if self.resources.len() >= ACTIVE_RESOURCES_MAX => {
                return Outcome::Exhausted(
                    Limit::ActiveResources,
                    format!(
                        "too many active resources ({ACTIVE_RESOURCES_MAX}): cannot lock {resource:?}"
                    ),
                );
            }
            None if tenant_active >= policy.active_resources_per_tenant_max => {
                return Outcome::Exhausted(
                    Limit::ActiveResourcesPerTenant,
                    format!(
                        "tenant {:?} has {tenant_active} active resources: limit \
                     active_resources_per_tenant_max is {}; cannot lock {resource:?}",
                        resource.tenant(),
                        policy.active_resources_per_tenant_max
                    ),
                );
            }
            None => ResourceState::default(),
        };

        let outcome = match &state.lease {
            None => {
                assert!(
                    state.waiters.is_empty(),
                    "INV-SINGLE-HOLDER: {resource} has {} waiters but no holder after settle",
                    state.waiters.len()
                );
                let grant = self.grant(
                    resource,
                    &mut state,
                    NewLease {
                        id: lease_id,
                        request_id,
                        holder,
                        lease_ttl_ms,
                    },
                    None,
                    events,
                );
                self.dedup_put(ident, DedupState::Granted(grant));
                Outcome::Granted(grant)
            }
            Some(lease) if wait_timeout_ms == 0 => {
                let holder = lease.holder.clone();
                if record_held {
                    self.dedup_put(ident, DedupState::Held);
                }
                Outcome::Held { holder }
            }
            Some(_) => self.enqueue(
                resource,
                &mut state,
                Waiter {
                    key,
                    request_id: request_id.to_owned(),
                    lease_id,
                    holder: holder.to_owned(),
                    lease_ttl_ms,
                    deadline_ms: self.now_ms.saturating_add(wait_timeout_ms as i64),
                },
                ident,
                policy,
                events,
            ),
        };
        self.put_back(resource, state);
        outcome
    }

    fn enqueue(
        &mut self,
        resource: &ResourceName,
        state: &mut ResourceState,
        waiter: Waiter,
        ident: Ident,
        policy: &Policy,
        events: &mut Vec<Event>,
    ) -> Outcome {
        if state.waiters.len() as u32 >= policy.waiters_per_resource_max {
            self.drop_oldest_abandoned(resource, state);
        }
        let queued = state.waiters.len() as u32;
        if queued >= policy.waiters_per_resource_max {
            return Outcome::Exhausted(
                Limit::WaitersPerResource,
                format!(
                    "resource {resource:?} has {queued} waiters: limit waiters_per_resource_max is {}",
                    policy.waiters_per_resource_max
                ),
            );
        }
        let tenant = resource.tenant();
        let tenant_count = self.tenant_waiters.get(tenant).copied().unwrap_or(0);
        if tenant_count >= policy.waiters_per_tenant_max {
            return Outcome::Exhausted(
                Limit::WaitersPerTenant,
                format!(
                    "tenant {tenant:?} has {tenant_count} waiters: limit waiters_per_tenant_max is {}",
                    policy.waiters_per_tenant_max
                ),
            );
        }
        *self.tenant_waiters.entry(tenant.to_owned()).or_insert(0) += 1;
        self.waiting += 1;
        self.wait_deadlines
            .insert((waiter.deadline_ms, resource.clone(), waiter.key));
        self.dedup_put(ident, DedupState::Waiting);
        events.push(Event {
            kind: EventKind::Queued,
            resource: resource.clone(),
            fencing_token: FencingToken(0),
            holder: waiter.holder.clone(),
            request_id: waiter.request_id.clone(),
        });
        let ahead = state
            .waiters
            .iter()
            .filter(|w| !self.abandoned.contains(&w.key))
            .count() as u32;
        state.waiters.push_back(waiter);
        Outcome::Queued {
            position: ahead + 1,
        }
    }

    fn renew(
        &mut self,
        resource: &ResourceName,
        lease_id: LeaseId,
        lease_ttl_ms: u64,
        events: &mut Vec<Event>,
    ) -> Outcome {
        self.settle(resource, events);
        let now = self.now_ms;
        // INV-CURRENT-LEASE-ONLY.
        let Some(lease) = self
            .resources
            .get_mut(resource)
            .and_then(|s| s.lease.as_mut())
            .filter(|l| l.id == lease_id)
        else {
            return Outcome::NotFound;
        };
        let ttl = if lease_ttl_ms == 0 {
            lease.lease_ttl_ms
        } else {
            lease_ttl_ms
        };
        self.expiries
            .remove(&(lease.expires_at_ms, resource.clone()));
        lease.lease_ttl_ms = ttl;
        lease.expires_at_ms = now.saturating_add(ttl as i64);
        self.expiries
            .insert((lease.expires_at_ms, resource.clone()));
        events.push(Event {
            kind: EventKind::Renewed,
            resource: resource.clone(),
            fencing_token: lease.token,
            holder: lease.holder.clone(),
            request_id: lease.request_id.clone(),
        });
        Outcome::Renewed {
            expires_at_ms: lease.expires_at_ms,
            lease_ttl_ms: ttl,
        }
    }

    fn release(
        &mut self,
        resource: &ResourceName,
        lease_id: LeaseId,
        events: &mut Vec<Event>,
    ) -> Outcome {
        self.settle(resource, events);
        let Some(mut state) = self.take(resource) else {
            return Outcome::Released(false);
        };
        // INV-CURRENT-LEASE-ONLY: a superseded lease id never touches the new holder.
        let released = state.lease.as_ref().is_some_and(|l| l.id == lease_id);
        if released {
            self.end_lease(resource, &mut state, EventKind::Released, events);
            self.hand_off(resource, &mut state, events);
        }
        self.put_back(resource, state);
        Outcome::Released(released)
    }

    fn end_wait(
        &mut self,
        resource: &ResourceName,
        request_id: &str,
        reason: EndWaitReason,
        attempt: Option<LeaseId>,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let ended = match reason {
            EndWaitReason::TimedOut => Outcome::WaitTimedOut,
            EndWaitReason::Cancelled => Outcome::WaitCancelled,
        };
        self.settle(resource, events);
        if let Some(mut state) = self.take(resource) {
            // By the request_id itself, so a digest collision can never remove another request.
            let found = state
                .waiters
                .iter()
                .position(|w| w.request_id == request_id);
            if let Some(index) = found {
                let current = attempt.is_none_or(|a| state.waiters[index].lease_id == a);
                if !current {
                    // A retry replaced that call: its registration stays.
                    self.put_back(resource, state);
                    return ended;
                }
                let key = state.waiters[index].key;
                match reason {
                    EndWaitReason::TimedOut => {
                        let waiter = state.waiters.remove(index).expect("index from position");
                        self.forget_waiter(resource, &waiter);
                        self.abandoned.remove(&key);
                        self.dedup.time_out(key);
                        events.push(waiter_event(
                            EventKind::TimedOut { waiter: key },
                            resource,
                            &waiter,
                        ));
                    }
                    EndWaitReason::Cancelled => {
                        // The place is kept for a retry of the same request_id (the caller may
                        // have lost its connection and be calling again); until then the
                        // waiter is skipped.
                        if self.abandoned.insert(key).is_none() {
                            events.push(waiter_event(
                                EventKind::Cancelled { waiter: key },
                                resource,
                                &state.waiters[index],
                            ));
                        }
                    }
                }
                self.put_back(resource, state);
                return ended;
            }
            self.put_back(resource, state);
        }
        // Not queued (any more): the log already decided. A grant that won the race is returned,
        // so the caller learns of the lease instead of leaving it to expire unseen.
        match self.lookup(request_id).map(|(_, state)| state) {
            Some(DedupState::Granted(grant)) => Outcome::Granted(self.refresh(resource, grant)),
            _ => ended,
        }
    }

    /// A retry of a queued request: it becomes the current attempt (its lease id is the one a
    /// grant will carry, and only a cancel of this attempt ends the wait) and takes back its
    /// place if its earlier call was cancelled. Returns its position, or `None` if the request
    /// is not queued on `resource`.
    fn reattach(
        &mut self,
        resource: &ResourceName,
        key: RequestKey,
        request_id: &str,
        attempt: LeaseId,
    ) -> Option<u32> {
        let state = self.resources.get_mut(resource)?;
        let waiter = state
            .waiters
            .iter_mut()
            .find(|w| w.key == key && w.request_id == request_id)?;
        waiter.lease_id = attempt;
        self.abandoned.remove(&key);
        self.position(resource, key, request_id)
    }

    /// Brings one resource up to the table's clock: expires its lease if due, times out waiters
    /// whose deadline passed, hands the lock to the next waiter, and deletes the record if idle.
    /// Every command on a resource settles it first, so a due lease never blocks anybody even
    /// before the reaper's command arrives.
    fn settle(&mut self, resource: &ResourceName, events: &mut Vec<Event>) {
        let Some(mut state) = self.take(resource) else {
            return;
        };
        let now = self.now_ms;
        if state.lease.as_ref().is_some_and(|l| l.expires_at_ms <= now) {
            self.end_lease(resource, &mut state, EventKind::Expired, events);
        }
        if state.waiters.iter().any(|w| w.deadline_ms <= now) {
            let (expired, kept): (VecDeque<Waiter>, VecDeque<Waiter>) =
                state.waiters.drain(..).partition(|w| w.deadline_ms <= now);
            state.waiters = kept;
            for waiter in expired {
                self.forget_waiter(resource, &waiter);
                if self.abandoned.remove(&waiter.key).is_some() {
                    // Its Cancelled event was emitted when its call went away.
                    self.dedup_forget(waiter.key);
                    continue;
                }
                self.dedup.time_out(waiter.key);
                events.push(waiter_event(
                    EventKind::TimedOut { waiter: waiter.key },
                    resource,
                    &waiter,
                ));
            }
        }
        if state.lease.is_none() {
            self.hand_off(resource, &mut state, events);
        }
        self.put_back(resource, state);
    }

    /// Passes a free lock to the head waiter, in the same command that freed it. Only that
    /// waiter's event carries its key, so only its call is woken.
    fn hand_off(
        &mut self,
        resource: &ResourceName,
        state: &mut ResourceState,
        events: &mut Vec<Event>,
    ) {
        assert!(
            state.lease.is_none(),
            "hand_off on held resource {resource}"
        );
        while let Some(waiter) = state.waiters.pop_front() {
            self.forget_waiter(resource, &waiter);
            if self.abandoned.remove(&waiter.key).is_some() {
                // Cancelled and not retried: nobody would receive the lease. A later retry
                // starts afresh, as after any cancel.
                self.dedup_forget(waiter.key);
                continue;
            }
            let grant = self.grant(
                resource,
                state,
                NewLease {
                    id: waiter.lease_id,
                    request_id: &waiter.request_id,
                    holder: &waiter.holder,
                    lease_ttl_ms: waiter.lease_ttl_ms,
                },
                Some(waiter.key),
                events,
            );
            // Remembered for the full retention after the grant, not after the enqueue.
            self.dedup
                .renew(waiter.key, self.now_ms, DedupState::Granted(grant));
            return;
        }
    }

    fn grant(
        &mut self,
        resource: &ResourceName,
        state: &mut ResourceState,
        new: NewLease<'_>,
        to_waiter: Option<RequestKey>,
        events: &mut Vec<Event>,
    ) -> Grant {
        assert!(
            state.lease.is_none(),
            "INV-SINGLE-HOLDER: granting {resource} while it is held"
        );
        let token = FencingToken(self.last_token + 1);
        assert!(
            token.0 > self.last_token,
            "INV-TOKEN-MONOTONIC: token {token} after {}",
            self.last_token
        );
        self.last_token = token.0;
        let expires_at_ms = self.now_ms.saturating_add(new.lease_ttl_ms as i64);
        state.lease = Some(Lease {
            id: new.id,
            token,
            holder: new.holder.to_owned(),
            request_id: new.request_id.to_owned(),
            lease_ttl_ms: new.lease_ttl_ms,
            expires_at_ms,
        });
        self.expiries.insert((expires_at_ms, resource.clone()));
        self.held += 1;
        let grant = Grant {
            lease_id: new.id,
            fencing_token: token,
            expires_at_ms,
            lease_ttl_ms: new.lease_ttl_ms,
        };
        events.push(Event {
            kind: EventKind::Granted { to_waiter, grant },
            resource: resource.clone(),
            fencing_token: token,
            holder: new.holder.to_owned(),
            request_id: new.request_id.to_owned(),
        });
        grant
    }

    fn end_lease(
        &mut self,
        resource: &ResourceName,
        state: &mut ResourceState,
        kind: EventKind,
        events: &mut Vec<Event>,
    ) {
        let lease = state.lease.take().expect("end_lease on a free resource");
        self.expiries
            .remove(&(lease.expires_at_ms, resource.clone()));
        self.held -= 1;
        events.push(Event {
            kind,
            resource: resource.clone(),
            fencing_token: lease.token,
            holder: lease.holder,
            request_id: lease.request_id,
        });
    }

    /// A cancelled waiter keeps its place for a retry of its own call, but never at the cost of
    /// a live caller: when a resource's queue is full, its oldest cancelled waiter leaves, as it
    /// would on reaching the head (a later retry starts afresh). O(queue length), which the
    /// per-resource limit bounds.
    fn drop_oldest_abandoned(&mut self, resource: &ResourceName, state: &mut ResourceState) {
        let Some(index) = state
            .waiters
            .iter()
            .position(|w| self.abandoned.contains(&w.key))
        else {
            return;
        };
        let waiter = state.waiters.remove(index).expect("index from position");
        self.forget_waiter(resource, &waiter);
        self.abandoned.remove(&waiter.key);
        self.dedup_forget(waiter.key);
    }

    fn forget_waiter(&mut self, resource: &ResourceName, waiter: &Waiter) {
        self.wait_deadlines
            .remove(&(waiter.deadline_ms, resource.clone(), waiter.key));
        self.waiting -= 1;
        let tenant = resource.tenant();
        if let Some(count) = self.tenant_waiters.get_mut(tenant) {
            *count -= 1;
            if *count == 0 {
                self.tenant_waiters.remove(tenant);
            }
        }
    }

    /// Re-inserts a resource's state, or drops it when idle: idle records cost nothing, and
    /// tokens come from the global counter, so deleting them never lets a token repeat.
    fn put_back(&mut self, resource: &ResourceName, state: ResourceState) {
        let active = state.lease.is_some() || !state.waiters.is_empty();
        if active && self.resources.insert(resource.clone(), state).is_none() {
            *self
                .tenant_resources
                .entry(resource.tenant().to_owned())
                .or_insert(0) += 1;
        }
    }

    /// Removes a resource's state to change it; [`LockTable::put_back`] returns it.
    fn take(&mut self, resource: &ResourceName) -> Option<ResourceState> {
        let state = self.resources.remove(resource)?;
        let tenant = resource.tenant();
        if let Some(count) = self.tenant_resources.get_mut(tenant) {
            *count -= 1;
            if *count == 0 {
                self.tenant_resources.remove(tenant);
            }
        }
        Some(state)
    }

    /// A grant as a retry should see it: with the current expiry while the lease is still current.
    fn refresh(&self, resource: &ResourceName, grant: Grant) -> Grant {
        match self
            .resources
            .get(resource)
            .and_then(|s| s.lease.as_ref())
            .filter(|l| l.id == grant.lease_id)
        {
            Some(lease) => Grant {
                expires_at_ms: lease.expires_at_ms,
                lease_ttl_ms: lease.lease_ttl_ms,
                ..grant
            },
            None => grant,
        }
    }

    /// 1-based place in the queue of `resource`, not counting abandoned waiters ahead.
    fn position(&self, resource: &ResourceName, key: RequestKey, request_id: &str) -> Option<u32> {
        let mut ahead = 0;
        for w in &self.resources.get(resource)?.waiters {
            if w.key == key && w.request_id == request_id {
                return Some(ahead + 1);
            }
            if !self.abandoned.contains(&w.key) {
                ahead += 1;
            }
        }
        None
    }

    fn dedup_put(&mut self, ident: Ident, state: DedupState) {
        if self.dedup.insert(ident, self.now_ms, state) && ident.tenant != 0 {
            *self.tenant_records.entry(ident.tenant).or_insert(0) += 1;
        }
    }

    /// Forgets a record: a later Acquire with its request_id starts afresh.
    fn dedup_forget(&mut self, key: RequestKey) {
        if let Some(tenant) = self.dedup.remove(key) {
            forgot_record(&mut self.tenant_records, tenant);
        }
    }

    /// What identifies an Acquire in the dedup window, keyed with the table's secret (the
    /// unkeyed hashes of older lockd while the table has none). Keyed, a client cannot
    /// construct two request_ids with one key or two argument lists with one digest, so a
    /// retry matches only its own record.
    fn ident(
        &self,
        request_id: &str,
        resource: &ResourceName,
        ttl: u64,
        wait: u64,
        holder: &str,
    ) -> Ident {
        match self.secret {
            Some(secret) => Ident {
                key: RequestKey(keyed(secret, b'k', &[request_id.as_bytes()])),
                args: keyed(
                    secret,
                    b'a',
                    &[
                        resource.as_str().as_bytes(),
                        &ttl.to_le_bytes(),
                        &wait.to_le_bytes(),
                        holder.as_bytes(),
                    ],
                ),
                // Never 0, which marks records whose tenant is not counted.
                tenant: self.tenant_tag(resource.tenant()),
                legacy: false,
            },
            None => Ident {
                key: RequestKey::of(request_id),
                args: u128::from(legacy_args_hash(resource, ttl, wait, holder)),
                tenant: 0,
                legacy: true,
            },
        }
    }

    /// The keyed 64-bit tag of a tenant (never 0); 0 while the table has no secret.
    fn tenant_tag(&self, tenant: &str) -> u64 {
        match self.secret {
            Some(secret) => (keyed(secret, b't', &[tenant.as_bytes()]) as u64) | 1,
            None => 0,
        }
    }

    /// The dedup record of `request_id`: under its keyed key, or, for records made before the
    /// table had a secret (at most one retention window after an upgrade), its legacy key.
    fn lookup(&self, request_id: &str) -> Option<(Ident, DedupState)> {
        let key = self.ident_key(request_id);
        if let Some(found) = self.dedup.get(key) {
            return Some(found);
        }
        if self.secret.is_some() {
            return self
                .dedup
                .get(RequestKey::of(request_id))
                .filter(|(ident, _)| ident.legacy);
        }
        None
    }

    fn ident_key(&self, request_id: &str) -> RequestKey {
        match self.secret {
            Some(secret) => RequestKey(keyed(secret, b'k', &[request_id.as_bytes()])),
            None => RequestKey::of(request_id),
        }
    }

    /// Whether a recorded Acquire had these arguments.
    fn same_args(
        &self,
        recorded: &Ident,
        now: &Ident,
        resource: &ResourceName,
        ttl: u64,
        wait: u64,
        holder: &str,
    ) -> bool {
        if recorded.legacy {
            recorded.args == u128::from(legacy_args_hash(resource, ttl, wait, holder))
        } else {
            !now.legacy && recorded.args == now.args
        }
    }

    /// Forgets dedup records older than the retention window (waiting ones excepted: see
    /// [`DedupWindow::prune`]).
    fn prune_dedup(&mut self, policy: &Policy) {
        let horizon = self.now_ms.saturating_sub(policy.dedup_retention_ms as i64);
        let counts = &mut self.tenant_records;
        self.dedup
            .prune(horizon, self.now_ms, |tenant| forgot_record(counts, tenant));
    }

    // ---- reads ----

    /// What Describe shows of `resource`; an unknown resource shows as not held, no waiters.
    pub fn describe(&self, resource: &ResourceName) -> ResourceView {
        let Some(state) = self.resources.get(resource) else {
            return ResourceView::default();
        };
        let mut view = ResourceView {
            waiters: state
                .waiters
                .iter()
                .filter(|w| !self.abandoned.contains(&w.key))
                .count() as u32,
            ..ResourceView::default()
        };
        if let Some(lease) = &state.lease {
            view.held = true;
            view.holder = lease.holder.clone();
            view.fencing_token = lease.token;
            view.expires_at_ms = lease.expires_at_ms;
        }
        view
    }

    /// The sequencer signing keys: the active one signs, all of them verify.
    pub fn signing_keys(&self) -> &SigningKeys {
        &self.keys
    }

    /// Table-wide counters, for Status and metrics.
    pub fn stats(&self) -> TableStats {
        TableStats {
            active_locks: self.held,
            waiters: self.waiting,
            resources: self.resources.len() as u64,
            dedup_records: self.dedup.len() as u64,
            last_token: self.last_token,
            now_ms: self.now_ms,
            term: self.term,
        }
    }

    /// The table time now, as the leader process `session` computes it from its monotonic clock
    /// reading `mono_ms`: `None` while the table's clock is not anchored to that process (a new
    /// leader must first commit a stamped batch, e.g. an empty one, before it can tell what is
    /// due).
    pub fn clock_now(&self, session: u64, mono_ms: u64) -> Option<i64> {
        let anchor = self.anchor.filter(|a| a.session == session)?;
        Some(self.now_ms.max(anchor.table_time(mono_ms)))
    }

    /// The clock anchor (for tests and diagnostics).
    pub fn clock_anchor(&self) -> Option<ClockAnchor> {
        self.anchor
    }

    /// Up to `max` resources with a lease or a waiter due at `now_ms`, earliest first: what the
    /// leader's reaper proposes `Reap` for.
    pub fn due(&self, now_ms: i64, max: usize) -> Vec<ResourceName> {
        let leases = self
            .expiries
            .iter()
            .take_while(|(at, _)| *at <= now_ms)
            .map(|(_, r)| r);
        let waits = self
            .wait_deadlines
            .iter()
            .take_while(|(at, _, _)| *at <= now_ms)
            .map(|(_, r, _)| r);
        let mut out: Vec<ResourceName> = Vec::new();
        let mut seen = BTreeSet::new();
        for r in leases.chain(waits) {
            if out.len() >= max {
                break;
            }
            if seen.insert(r) {
                out.push(r.clone());
            }
        }
        out
    }

    /// The `n` resources with the longest queues (ties by name), for Status.
    pub fn top_by_waiters(&self, n: usize) -> Vec<(ResourceName, u32)> {
        let mut all: Vec<(ResourceName, u32)> = self
            .resources
            .iter()
            .filter(|(_, s)| !s.waiters.is_empty())
            .map(|(r, s)| (r.clone(), s.waiters.len() as u32))
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        all.truncate(n);
        all
    }

    /// Checks the table's internal consistency (indexes against records). O(n): for tests and
    /// snapshot loading, not the apply path.
    pub fn check_consistency(&self) -> Result<(), String> {
        let mut held = 0;
        let mut waiting = 0;
        let mut tenants: OrdMap<String, u32> = OrdMap::new();
        let mut expiries = OrdSet::new();
        let mut deadlines = OrdSet::new();
        // Waiter keys across all queues: a request is queued at most once anywhere.
        let mut keys = BTreeSet::new();
        for (name, state) in &self.resources {
            if state.lease.is_none() && state.waiters.is_empty() {
                return Err(format!("idle record kept for {name}"));
            }
            if state.lease.is_none() && !state.waiters.is_empty() {
                return Err(format!("{name} has waiters but no holder"));
            }
            if let Some(l) = &state.lease {
                held += 1;
                if l.token.0 > self.last_token {
                    return Err(format!(
                        "{name} token {} above last {}",
                        l.token, self.last_token
                    ));
                }
                expiries.insert((l.expires_at_ms, name.clone()));
            }
            for w in &state.waiters {
                waiting += 1;
                if !keys.insert(w.key) {
                    return Err(format!(
                        "{name} queues {} twice",
                        shown_request_id(&w.request_id)
                    ));
                }
                *tenants.entry(name.tenant().to_owned()).or_default() += 1;
                deadlines.insert((w.deadline_ms, name.clone(), w.key));
                match self.dedup.get(w.key).map(|(_, state)| state) {
                    Some(DedupState::Waiting) => {}
                    other => {
                        return Err(format!(
                            "waiter {} has dedup state {other:?}",
                            shown_request_id(&w.request_id)
                        ));
                    }
                }
            }
        }
        if held != self.held || waiting != self.waiting {
            return Err(format!(
                "counters held={} waiting={} but counted {held} and {waiting}",
                self.held, self.waiting
            ));
        }
        self.dedup.check()?;
        // Checked like lease tokens: a retry answers a record's token, so one above the counter
        // would be answered now and granted again later (INV-TOKEN-MONOTONIC).
        if let Some((i, token)) = self.dedup.token_above(self.last_token) {
            return Err(format!(
                "request-id record {i} holds fencing token {token}, above the last token issued \
                 {}: a retry would be answered with a token that a later grant gets again",
                self.last_token
            ));
        }
        // Every Waiting record has its waiter (the loop above checked the converse), or a retry
        // would look for a queue entry that does not exist.
        if self.dedup.waiting() as u64 != waiting {
            return Err(format!(
                "{} dedup records are waiting but {waiting} waiters are queued",
                self.dedup.waiting()
            ));
        }
        if expiries != self.expiries
            || deadlines != self.wait_deadlines
            || tenants != self.tenant_waiters
        {
            return Err("an index disagrees with the records".into());
        }
        if let Some(key) = self.abandoned.iter().find(|k| !keys.contains(*k)) {
            return Err(format!("abandoned waiter {key:?} is not queued"));
        }
        let mut active: OrdMap<String, u32> = OrdMap::new();
        for name in self.resources.keys() {
            *active.entry(name.tenant().to_owned()).or_default() += 1;
        }
        if active != self.tenant_resources {
            return Err("active resources per tenant disagree with the records".into());
        }
        let mut records: OrdMap<u64, u32> = OrdMap::new();
        for tag in self.dedup.tenants().filter(|t| *t != 0) {
            *records.entry(tag).or_default() += 1;
        }
        if records != self.tenant_records {
            return Err("dedup records per tenant disagree with the records".into());
        }
        self.keys.check()?;
        Ok(())
    }
}

/// Counts one record of `tenant` less.
fn forgot_record(counts: &mut OrdMap<u64, u32>, tenant: u64) {
    if let Some(count) = counts.get_mut(&tenant) {
        *count -= 1;
        if *count == 0 {
            counts.remove(&tenant);
        }
    }
}

/// The parameters of a lease about to be granted.
struct NewLease<'a> {
    id: LeaseId,
    request_id: &'a str,
    holder: &'a str,
    lease_ttl_ms: u64,
}

fn waiter_event(kind: EventKind, resource: &ResourceName, waiter: &Waiter) -> Event {
    Event {
        kind,
        resource: resource.clone(),
        fencing_token: FencingToken(0),
        holder: waiter.holder.clone(),
        request_id: waiter.request_id.clone(),
    }
}

/// A keyed 128-bit digest (SipHash-1-3) of length-prefixed `parts` in `domain`, so fields cannot
/// run into each other and digests of different kinds never coincide by construction.
fn keyed(secret: u128, domain: u8, parts: &[&[u8]]) -> u128 {
    use siphasher::sip128::Hasher128;
    use std::hash::Hasher;
    let mut h = siphasher::sip128::SipHasher13::new_with_keys(secret as u64, (secret >> 64) as u64);
    h.write_u8(domain);
    for part in parts {
        h.write(&(part.len() as u64).to_le_bytes());
        h.write(part);
    }
    let digest = h.finish128().as_u128();
    #[cfg(test)]
    let digest = tests::collide(digest);
    digest
}

/// The unkeyed hash of an Acquire's arguments of lockd before the table had a secret
/// (length-prefixed so fields cannot run into each other); kept to match records made then.
fn legacy_args_hash(resource: &ResourceName, ttl: u64, wait: u64, holder: &str) -> u64 {
    let mut buf = Vec::with_capacity(resource.as_str().len() + holder.len() + 32);
    buf.extend_from_slice(&(resource.as_str().len() as u64).to_le_bytes());
    buf.extend_from_slice(resource.as_str().as_bytes());
    buf.extend_from_slice(&ttl.to_le_bytes());
    buf.extend_from_slice(&wait.to_le_bytes());
    buf.extend_from_slice(&(holder.len() as u64).to_le_bytes());
    buf.extend_from_slice(holder.as_bytes());
    xxhash_rust::xxh3::xxh3_64(&buf)
}

/// One Acquire's arguments, as apply reads them from either command form.
struct AcquireArgs<'a> {
    resource: &'a ResourceName,
    request_id: &'a str,
    lease_ttl_ms: u64,
    wait_timeout_ms: u64,
    holder: &'a str,
    lease_id: LeaseId,
    /// Record a `Held` answer under the request_id ([`Command::AcquireV2`]); `Acquire` entries
    /// of older logs did not, and replay the same way.
    record_held: bool,
}

mod dedup;
mod restore;
mod snapshot;
#[cfg(test)]
mod tests;

use dedup::{DedupState, DedupWindow, Ident};
pub use restore::RestoreReport;
pub use snapshot::{SnapshotCopy, SnapshotError};
