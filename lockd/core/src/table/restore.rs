//! Seeding a new cluster from a backup (`lockd restore`): the one change a restore makes to the
//! table it read from the backup, before any replica applies anything to it.
//!
//! A backup is older than the disaster it recovers from: grants made after it are lost, and
//! their tokens, or tokens a fence store accepted, may be higher than the backup's counter.
//! [`LockTable::prepare_restore`] therefore raises the token counter to the operator's floor, so
//! the restored cluster's first grant is above both. Leases and waiters of the backup are kept
//! (their holders may be alive), but each lease is made to last at least a full ttl from the
//! restored cluster's first command, so that it also outlasts the local deadline of a holder
//! whose newer grant the backup does not have (same rule as `INV-CONSERVATIVE-FAILOVER`). A
//! holder of the backup that was superseded after it has a token below the floor: fence stores
//! that saw the newer token refuse it.
//!
//! The backup's active signing key is retired, so the restored cluster's first leader installs
//! a key of its own (`ensure_key` in lockd-server). A sequencer names its key, not its cluster:
//! had the restored cluster kept signing with the backup's key, the backed-up cluster (still
//! running, or back) and a restored copy of it (a disaster-recovery drill, a staging copy) would
//! issue tokens from overlapping ranges with sequencers that the same fence stores accept, the
//! same (resource, token) to two holders. Only the retirement is part of the restored state (at
//! the table's time, which every member restored alike reads the same), so every member still
//! holds the same table; the new key is made once, by the leader, and replicated. The retired
//! key stays listed, so sequencers of the kept leases still verify.

use lockd_fence::sequencer::KeyId;

use super::LockTable;

/// What [`LockTable::prepare_restore`] did, for the operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestoreReport {
    /// The last token the backed-up cluster had issued when the backup was taken.
    pub backup_last_token: u64,
    /// The floor the operator gave (the highest token any fence store accepted).
    pub token_floor: u64,
    /// The counter now: the restored cluster's first grant gets this plus one.
    pub last_token: u64,
    /// Leases kept.
    pub leases: u64,
    /// Leases that now end later than the backup said (a full ttl after restore).
    pub leases_extended: u64,
    /// Waiters kept (each leaves the queue at its own deadline).
    pub waiters: u64,
    /// Request-id records kept, so retries of acquires made before the backup get their
    /// original answer.
    pub dedup_records: u64,
    /// The backup's active signing key, now retired (`None`: the backup had no key).
    pub retired_key: Option<KeyId>,
    /// A retired key forgotten to make room for the restored cluster's own key (only when the
    /// backup kept the most keys allowed).
    pub forgotten_key: Option<KeyId>,
}

impl LockTable {
    /// Prepares a table read from a backup to seed a new cluster; see the module docs.
    ///
    /// - The token counter becomes `max(backup's last token, token_floor)`, so every token the
    ///   restored cluster issues is above both (`INV-TOKEN-MONOTONIC` across a restore).
    /// - Every lease ends no earlier than the table's time plus its ttl. The table's clock stands
    ///   still from the backup until the restored cluster's first leader stamps a batch, so this
    ///   is a full ttl after the restored cluster starts.
    /// - The clock anchor is cleared, so that the first stamp of the new cluster anchors the
    ///   clock at the table's time whatever its term (the backup's anchor names a term and a
    ///   process of the old cluster; a stamp of a lower term would leave the clock frozen).
    /// - The active signing key is retired at the table's time, so the restored cluster's first
    ///   leader installs a key of its own ([`crate::SigningKeys::retire_active`]).
    pub fn prepare_restore(&mut self, token_floor: u64) -> RestoreReport {
        let backup_last_token = self.last_token;
        self.last_token = self.last_token.max(token_floor);
        let leases_extended = self.extend_leases_to_full_ttl();
        self.anchor = None;
        let (retired_key, forgotten_key) = self.keys.retire_active(self.now_ms);
        let stats = self.stats();
        RestoreReport {
            backup_last_token,
            token_floor,
            last_token: self.last_token,
            leases: stats.active_locks,
            leases_extended,
            waiters: stats.waiters,
            dedup_records: stats.dedup_records,
            retired_key,
            forgotten_key,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::KeyRecord;
    use crate::command::{Batch, Command, Outcome, Stamp};
    use crate::limits::{Policy, SIGNING_KEYS_MAX};
    use crate::types::{LeaseId, ResourceName};

    use super::*;

    fn acquire(resource: &str, request_id: &str, ttl_ms: u64, id: u128) -> Command {
        Command::Acquire {
            resource: ResourceName::new_unchecked(resource.into()),
            request_id: request_id.into(),
            lease_ttl_ms: ttl_ms,
            wait_timeout_ms: 0,
            holder: "h".into(),
            lease_id: LeaseId(id),
        }
    }

    fn batch(term: u64, session: u64, mono_ms: u64, commands: Vec<Command>) -> Batch {
        Batch {
            now_ms: 1_000_000,
            stamp: Some(Stamp {
                term,
                session,
                mono_ms,
                key_seed: 0x5eed,
            }),
            policy: Policy::default(),
            commands,
        }
    }

    fn token(outcome: &Outcome) -> u64 {
        match outcome {
            Outcome::Granted(g) => g.fencing_token.0,
            other => panic!("not granted: {other:?}"),
        }
    }

    /// The backed-up table: three grants in term 7 (ttl 30 s, 30 s, 60 s), 20 s later.
    fn backed_up() -> LockTable {
        let mut table = LockTable::new();
        let cmds = vec![
            acquire("a", "r1", 30_000, 1),
            acquire("b", "r2", 30_000, 2),
            acquire("c", "r3", 60_000, 3),
        ];
        table.apply(7, &batch(7, 70, 0, cmds), &mut Vec::new());
        // 20 s later (same leader process).
        table.apply(7, &batch(7, 70, 20_000, vec![]), &mut Vec::new());
        table.check_consistency().unwrap();
        table
    }

    /// Goal: after a restore the first grant's token is above the floor and above every token of
    /// the backup; a floor below the backup's counter changes nothing; retries of acquires from
    /// before the backup still answer their original grant.
    #[test]
    fn the_first_grant_after_restore_is_above_the_floor_and_the_backup() {
        for floor in [0, 2, 3, 1_000] {
            let mut table = LockTable::decode_snapshot(&backed_up().encode_snapshot()).unwrap();
            let report = table.prepare_restore(floor);
            table.check_consistency().unwrap();
            assert_eq!(report.backup_last_token, 3);
            assert_eq!(report.last_token, floor.max(3));
            assert_eq!((report.leases, report.waiters), (3, 0));
            // A new cluster: another term, another process, terms lower than the backup's too.
            let out = table.apply(
                2,
                &batch(
                    2,
                    99,
                    5,
                    vec![acquire("d", "r4", 30_000, 4), acquire("a", "r1", 30_000, 5)],
                ),
                &mut Vec::new(),
            );
            assert_eq!(token(&out[0]), floor.max(3) + 1, "floor {floor}");
            // The retry answers the original grant (token 1, lease 1).
            match &out[1] {
                Outcome::Granted(g) => assert_eq!((g.fencing_token.0, g.lease_id), (1, LeaseId(1))),
                other => panic!("{other:?}"),
            }
            table.check_consistency().unwrap();
        }
    }

    /// A new signing key, as a leader makes one.
    fn install_key(replaces: Option<[u8; 8]>) -> Command {
        Command::InstallSigningKey {
            pkcs8: lockd_fence::sequencer::SigningKey::generate()
                .pkcs8_der()
                .to_vec(),
            replaces,
        }
    }

    fn installed(outcome: &Outcome) -> [u8; 8] {
        match outcome {
            Outcome::SigningKeyInstalled { key_id } => *key_id,
            other => panic!("key not installed: {other:?}"),
        }
    }

    /// Goal: a restored cluster never signs with the backed-up cluster's key (review of the
    /// restore, H2: the active key kept signing, so a drill or staging copy restored from a
    /// production backup, or the old cluster and the restored one side by side, signed
    /// sequencers for the same (resource, token) that the same fence stores accept). The
    /// backup's active key is retired at the table's time, so every member restored alike holds
    /// the same keys; it stays listed, so sequencers of the kept leases still verify; the
    /// restored cluster's first leader then installs a key of its own (`replaces` = none, as
    /// `ensure_key` proposes it), also when the backup kept as many keys as allowed.
    /// Method: backups with one key and with `SIGNING_KEYS_MAX` keys rotated within the keep
    /// time; restore each twice from the same bytes; install as a new cluster's leader does.
    #[test]
    fn a_restore_retires_the_backups_active_key() {
        for kept in [1, SIGNING_KEYS_MAX] {
            let mut backup = backed_up();
            let mut active = None;
            for _ in 0..kept {
                let out = backup.apply(
                    7,
                    &batch(7, 70, 20_000, vec![install_key(active)]),
                    &mut Vec::new(),
                );
                active = Some(installed(&out[0]));
            }
            let backup_key = active.expect("a key");
            let bytes = backup.encode_snapshot();
            let at_backup = backup.stats().now_ms;

            let mut table = LockTable::decode_snapshot(&bytes).unwrap();
            table.prepare_restore(10);
            table.check_consistency().unwrap();
            let keys = table.signing_keys();
            assert!(
                keys.active().is_none(),
                "{kept} keys: the restored table still signs with the backup's key {}",
                KeyRecord::id(keys.active().unwrap())
            );
            let old = keys.all().iter().find(|k| k.key_id == backup_key);
            assert_eq!(
                old.map(|k| k.retired_ms),
                Some(Some(at_backup)),
                "{kept} keys"
            );
            // Restored alike, byte for byte (the restore id covers only file, floor, members).
            let mut again = LockTable::decode_snapshot(&bytes).unwrap();
            again.prepare_restore(10);
            assert_eq!(again.encode_snapshot(), table.encode_snapshot());

            // The restored cluster's first leader, in a lower term, right after its anchor.
            let out = table.apply(
                2,
                &batch(2, 99, 5, vec![install_key(None)]),
                &mut Vec::new(),
            );
            let new_key = installed(&out[0]);
            assert_ne!(new_key, backup_key);
            let keys = table.signing_keys();
            assert_eq!(keys.active().map(|k| k.key_id), Some(new_key));
            assert!(
                keys.all().iter().any(|k| k.key_id == backup_key),
                "{kept} keys"
            );
            assert!(keys.all().len() <= SIGNING_KEYS_MAX);
            table.check_consistency().unwrap();
        }
    }

    /// Goal: a kept lease lasts a full ttl from the restored cluster's first stamp, not only what
    /// was left of it at the backup, and the clock runs again in a new cluster of a lower term.
    #[test]
    fn kept_leases_last_a_full_ttl_from_the_restored_clusters_start() {
        let mut table = backed_up();
        let at_backup = table.stats().now_ms;
        let left = table.describe(&ResourceName::new_unchecked("a".into()));
        assert_eq!(left.expires_at_ms, at_backup + 10_000);
        let report = table.prepare_restore(0);
        // a and b had 10 s of 30 left, c 40 s of 60: all now have their full ttl.
        assert_eq!(report.leases_extended, 3);
        let a = table.describe(&ResourceName::new_unchecked("a".into()));
        assert_eq!(a.expires_at_ms, at_backup + 30_000);
        let c = table.describe(&ResourceName::new_unchecked("c".into()));
        assert_eq!(c.expires_at_ms, at_backup + 60_000);

        // Term 1 < the backup's 7: the clock must still move (first stamp anchors at backup time).
        table.apply(1, &batch(1, 5, 1_000, vec![]), &mut Vec::new());
        assert_eq!(table.stats().now_ms, at_backup);
        table.apply(1, &batch(1, 5, 30_001, vec![]), &mut Vec::new());
        assert_eq!(table.stats().now_ms, at_backup + 29_001);
        // 31 s after the restored start: a's lease is due and a new holder gets a higher token.
        let out = table.apply(
            1,
            &batch(1, 5, 32_000, vec![acquire("a", "n1", 30_000, 9)]),
            &mut Vec::new(),
        );
        assert_eq!(token(&out[0]), 4);
        table.check_consistency().unwrap();
    }
}
