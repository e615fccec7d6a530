//! Requests in flight per client address. `--max-in-flight` bounds them for the whole proxy and
//! `--max-connections-per-client` the connections of one address, but one HTTP/2 connection
//! carries 128 requests at once: a client with a few connections of slow requests (slow bodies,
//! responses it does not read, writes waiting behind a quarantine) held every place of
//! `--max-in-flight`, and every other client's requests waited behind them. Past its own bound
//! a client's requests wait for its own to end, before they take a place of the proxy's.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::sync::Semaphore;

/// A request's future, boxed: it waits for a place before calling the inner service.
type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// The places of every client address that has a connection open.
pub(crate) struct ClientsInFlight {
    per_client: usize,
    /// Per address: its open connections and its places. An address is removed with its last
    /// connection (a request of it still waiting keeps its own handle on the places).
    by_address: Mutex<HashMap<IpAddr, (usize, Arc<Semaphore>)>>,
}

impl ClientsInFlight {
    pub(crate) fn new(per_client: usize) -> Arc<Self> {
        Arc::new(ClientsInFlight {
            per_client,
            by_address: Mutex::default(),
        })
    }

    /// The places of `address`, shared by its connections while one of them is open.
    pub(crate) fn of(self: &Arc<Self>, address: IpAddr) -> ClientPlaces {
        let address = address.to_canonical();
        let places = {
            let mut table = self.lock();
            let (connections, places) = table
                .entry(address)
                .or_insert_with(|| (0, Arc::new(Semaphore::new(self.per_client))));
            *connections += 1;
            places.clone()
        };
        ClientPlaces {
            clients: self.clone(),
            address,
            places,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, (usize, Arc<Semaphore>)>> {
        self.by_address
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    #[cfg(test)]
    fn addresses(&self) -> usize {
        self.lock().len()
    }
}

/// One connection's hold on its address's places; the address is forgotten when its last
/// connection is gone, so the table holds only addresses with connections open.
pub(crate) struct ClientPlaces {
    clients: Arc<ClientsInFlight>,
    address: IpAddr,
    places: Arc<Semaphore>,
}

impl Drop for ClientPlaces {
    fn drop(&mut self) {
        let mut table = self.clients.lock();
        if let Some((connections, _)) = table.get_mut(&self.address) {
            *connections -= 1;
            if *connections == 0 {
                table.remove(&self.address);
            }
        }
    }
}

/// A connection's service: each request waits for a place of its client, then goes to `inner`
/// (which takes a place of the proxy's `--max-in-flight`) and holds its place until `inner` has
/// answered.
#[derive(Clone)]
pub(crate) struct PerClient<S> {
    inner: S,
    places: Arc<ClientPlaces>,
}

impl<S> PerClient<S> {
    pub(crate) fn new(inner: S, places: ClientPlaces) -> Self {
        PerClient {
            inner,
            places: Arc::new(places),
        }
    }
}

impl<S, Req> tower::Service<Req> for PerClient<S>
where
    S: tower::Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    Req: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is the inner service's, checked once this request has its client's place:
        // asking it here would take a place of the proxy's while the request waits for its own.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let inner = self.inner.clone();
        let places = self.places.clone();
        Box::pin(async move {
            let _place = places
                .places
                .clone()
                .acquire_owned()
                .await
                .expect("a client's places are never closed");
            let mut inner = inner;
            tower::ServiceExt::ready(&mut inner).await?;
            inner.call(request).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tower::{Service, ServiceExt};

    /// Goal: past its bound a client's requests wait for its own, while another address's go
    /// through; the table forgets an address once its last connection is gone.
    #[tokio::test]
    async fn a_client_waits_for_its_own_places_only() {
        let clients = ClientsInFlight::new(2);
        let gate = Arc::new(tokio::sync::Notify::new());
        let inner = tower::service_fn({
            let gate = gate.clone();
            move |slow: bool| {
                let gate = gate.clone();
                async move {
                    if slow {
                        gate.notified().await;
                    }
                    Ok::<_, std::convert::Infallible>(slow)
                }
            }
        });
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let mut conn_a = PerClient::new(inner.clone(), clients.of(a));
        let mut conn_a2 = PerClient::new(inner.clone(), clients.of(a));
        let mut slow = Vec::new();
        for _ in 0..2 {
            slow.push(tokio::spawn(conn_a.ready().await.unwrap().call(true)));
        }
        tokio::task::yield_now().await;
        // A third request of the same address, on another connection, waits.
        let third = tokio::spawn(conn_a2.ready().await.unwrap().call(false));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !third.is_finished(),
            "past its bound a client's request went through"
        );
        // Another address is not held up.
        let mut conn_b = PerClient::new(inner.clone(), clients.of(b));
        let answered = tokio::time::timeout(
            Duration::from_secs(1),
            conn_b.ready().await.unwrap().call(false),
        )
        .await
        .expect("another address waited for the first one's requests");
        assert!(!answered.unwrap());
        // One slow request ends: the waiting one gets its place.
        gate.notify_one();
        tokio::time::timeout(Duration::from_secs(1), third)
            .await
            .expect("a freed place was not given to the waiting request")
            .unwrap()
            .unwrap();
        gate.notify_one();
        for s in slow {
            s.await.unwrap().unwrap();
        }
        assert_eq!(clients.addresses(), 2);
        drop((conn_a, conn_a2));
        assert_eq!(
            clients.addresses(),
            1,
            "a's places outlived its connections"
        );
        drop(conn_b);
        assert_eq!(clients.addresses(), 0);
    }
}
