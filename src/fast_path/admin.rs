//! The [`Admin`] operations through the fast path: the durable store's, and the cached copy of
//! a record forgotten whenever the record changes underneath it.
//!
//! A settled or evicted record's cached response is deleted from Redis **before** the store is
//! changed, and once more after (best effort): a retry never replays an answer the store no
//! longer holds. When Redis cannot be reached the operation is refused
//! ([`StoreError::Unavailable`]) and the store is left as it was, because a cached copy that
//! outlived its record would keep replaying until its TTL. Records that expire are not
//! forgotten one by one: a cached copy never outlives its record's response retention (see the
//! [module docs](super)). `processing` and `unknown` records are never cached, so sweeping
//! leases and handing records to reconcilers need no Redis call.

use super::FastPath;
use super::scripts::{self, Keys};
use crate::key::{RecordId, Scope};
use crate::store::{
    Admin, Backoff, LeaseSweep, RecordInfo, SettleError, SettleRequest, StateCounts, Store, StoreError,
};

impl<S: Store + Admin> FastPath<S> {
    /// Deletes the cached response of `id`, if the fast path uses Redis at all.
    async fn forget(&self, id: &RecordId) -> Result<(), StoreError> {
        let Some(keying) = self.keying().await else { return Ok(()) };
        let keys = Keys::new(&self.options.prefix, keying.namespace(), id);
        scripts::forget(&self.link.connection, &keys, self.options.timeout).await.map_err(|failure| {
            self.link.failed(self.options.cooldown, id, &failure);
            StoreError::Unavailable(format!("the fast path could not forget its cached copy: {failure}").into())
        })
    }
}

impl<S: Store + Admin> Admin for FastPath<S> {
    async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError> {
        self.inner.inspect(id).await
    }

    async fn inspect_operation(&self, scope: &Scope, operation_id: &str) -> Result<Option<RecordInfo>, StoreError> {
        self.inner.inspect_operation(scope, operation_id).await
    }

    async fn list_unknown(&self, limit: usize) -> Result<Vec<RecordInfo>, StoreError> {
        self.inner.list_unknown(limit).await
    }

    async fn counts(&self) -> Result<StateCounts, StoreError> {
        self.inner.counts().await
    }

    async fn open_counts(&self) -> Result<StateCounts, StoreError> {
        self.inner.open_counts().await
    }

    async fn settle(&self, request: SettleRequest<'_>) -> Result<(), SettleError> {
        let id = *request.id;
        self.forget(&id).await?;
        let settled = self.inner.settle(request).await;
        let _ = self.forget(&id).await;
        settled
    }

    async fn evict(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.forget(id).await?;
        let evicted = self.inner.evict(id).await;
        let _ = self.forget(id).await;
        evicted
    }

    async fn sweep_leases(&self, limit: usize) -> Result<LeaseSweep, StoreError> {
        self.inner.sweep_leases(limit).await
    }

    async fn checkout_unknown(
        &self,
        operation: &str,
        limit: usize,
        backoff: Backoff,
    ) -> Result<Vec<RecordInfo>, StoreError> {
        self.inner.checkout_unknown(operation, limit, backoff).await
    }
}
