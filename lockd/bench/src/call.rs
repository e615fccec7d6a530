//! One lockd call with the bench's own deadline, and its failure as (code, message).

use std::future::Future;
use std::time::{Duration, Instant};

use crate::stats::{CLIENT_TIMEOUT, code_name};

/// Why a call failed, as it goes into the report.
#[derive(Debug)]
pub struct CallError {
    /// gRPC code name, or `CLIENT_TIMEOUT`.
    pub code: &'static str,
    pub message: String,
}

/// Awaits `call` until `deadline`; `limit` is what the deadline means, for the message.
pub async fn call<T>(
    deadline: Instant,
    limit: Duration,
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, CallError> {
    match tokio::time::timeout_at(deadline.into(), call).await {
        Ok(Ok(reply)) => Ok(reply.into_inner()),
        Ok(Err(status)) => Err(CallError {
            code: code_name(status.code()),
            message: status.message().to_owned(),
        }),
        Err(_) => Err(CallError {
            code: CLIENT_TIMEOUT,
            message: format!("no reply within {limit:?} (outcome unknown)"),
        }),
    }
}
