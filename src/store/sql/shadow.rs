//! Shadow mode's records on the SQL stores ([`Store::record_shadow`](crate::store::Store::record_shadow)):
//! a batch of entries written by one statement, on a connection of its own, after the answers
//! have left. Only the records that were already there are read back, one by one, for what
//! enforce mode would have answered from them.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use super::dialect::Dialect;
use super::{RecordRow, Records, acquire_by, unavailable};
use crate::fingerprint::Fingerprint;
use crate::store::decide::{Decision, decide};
use crate::store::{ShadowEntry, ShadowSeen, StaleLeasePolicy, StoreError};

/// How long recording a batch may wait for a connection.
const CONNECTION_WAIT: Duration = Duration::from_secs(5);

/// Writes `entries` (of distinct identities) with one statement
/// ([`Statements::shadow_batch`](super::statements::Statements::shadow_batch)), then reads the
/// record of each entry it did not write.
pub(crate) async fn record_shadow<D: Dialect>(
    records: &Records<D>,
    entries: Vec<ShadowEntry>,
) -> Result<Vec<ShadowSeen>, StoreError> {
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let deadline = Instant::now() + CONNECTION_WAIT;
    let written = {
        let mut conn = acquire_by(&records.pool, deadline).await.map_err(unavailable)?;
        let ids = D::fetch_ids(&mut conn, records.statements.shadow_batch(&entries)).await.map_err(unavailable)?;
        ids.into_iter().collect::<BTreeSet<Vec<u8>>>()
    };
    let mut seen = Vec::with_capacity(entries.len());
    for entry in &entries {
        if written.contains(entry.id.digest().as_slice()) {
            seen.push(ShadowSeen::Recorded);
            continue;
        }
        // Another record holds the shadow identity: what is it?
        seen.push(match records.read(&entry.id, Instant::now() + CONNECTION_WAIT).await {
            Ok(row) => shadow_seen(row, &entry.fingerprint),
            Err(error) => ShadowSeen::NotRecorded(Some(error)),
        });
    }
    Ok(seen)
}

/// What enforce mode would have answered from the record `row` held under a shadow identity.
fn shadow_seen(row: Option<RecordRow>, fingerprint: &Fingerprint) -> ShadowSeen {
    let Some(row) = row.filter(|row| !row.forgotten) else {
        return ShadowSeen::NotRecorded(None);
    };
    let found = match row.found() {
        Ok(found) => found,
        Err(error) => return ShadowSeen::NotRecorded(Some(error)),
    };
    match decide(&found, fingerprint, StaleLeasePolicy::MarkUnknown) {
        Decision::Answer(state) => match row.answer(&found, state, fingerprint) {
            Ok(record) => ShadowSeen::Existing(record),
            Err(error) => ShadowSeen::NotRecorded(Some(error)),
        },
        Decision::Claim => ShadowSeen::NotRecorded(None),
        Decision::Wait { .. } | Decision::MarkUnknown | Decision::TakeOver => ShadowSeen::InFlight,
    }
}
