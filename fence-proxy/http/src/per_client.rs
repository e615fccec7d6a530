//! Requests in flight per client address. `--max-in-flight` bounds them for the whole proxy and
//! `--max-connections-per-client` the connections of one address, but one HTTP/2 connection
//! carries 128 requests at once: a client with a few connections of slow requests (slow request
//! bodies, writes waiting behind a quarantine, reads of a slow upstream) held every place of
//! `--max-in-flight`, and every other client's requests waited behind them. Past its own bound
//! a client's requests wait for its own to end, before they take a place of the proxy's. A
//! read's place comes back with its response head (as the proxy's own), a write's when its
//! write task ends.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::sync::Semaphore;

/// A request's future, boxed: it waits for a place before calling the inner service.
type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// The places of every client address that has a connection open or a place held.
pub(crate) struct ClientsInFlight {
    per_client: usize,
    /// Per address: its open connections and its places. An address is removed once it has no
    /// connection open and every place is back (a write task may hold one after its
    /// connection closed), so the table holds only addresses that hold something.
    by_address: Mutex<HashMap<IpAddr, (usize, Arc<Semaphore>)>>,
}

impl ClientsInFlight {
    pub(crate) fn new(per_client: usize) -> Arc<Self> {
        Arc::new(ClientsInFlight {
            per_client,
            by_address: Mutex::default(),
        })
    }

    /// The places of `address`, shared by its connections and the places they hand out.
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

    /// Forgets `address` if it holds nothing any more. Called under no lock; places are given
    /// back before, so the last one back (or the last connection to close) removes it.
    fn forget_if_idle(&self, address: IpAddr) {
        let mut table = self.lock();
        if let Some((connections, places)) = table.get(&address)
            && *connections == 0
            && places.available_permits() == self.per_client
        {
            table.remove(&address);
        }
    }

    #[cfg(test)]
    fn addresses(&self) -> usize {
        self.lock().len()
    }
}

/// One connection's hold on its address's places.
pub(crate) struct ClientPlaces {
    clients: Arc<ClientsInFlight>,
    address: IpAddr,
    places: Arc<Semaphore>,
}

impl ClientPlaces {
    /// A place of the address, once one is free.
    async fn acquire(&self) -> ClientPlace {
        let permit = self
            .places
            .clone()
            .acquire_owned()
            .await
            .expect("a client's places are never closed");
        ClientPlace {
            permit: Some(permit),
            clients: self.clients.clone(),
            address: self.address,
        }
    }
}

impl Drop for ClientPlaces {
    fn drop(&mut self) {
        if let Some((connections, _)) = self.clients.lock().get_mut(&self.address) {
            *connections -= 1;
        }
        self.clients.forget_if_idle(self.address);
    }
}

/// One place of a client address: a request's until it is answered, or, for a write, its
/// write task's until the write has ended (the task outlives the request when the client goes
/// away, and must count against that client, not only against the proxy's write slots).
pub(crate) struct ClientPlace {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    clients: Arc<ClientsInFlight>,
    address: IpAddr,
}

impl Drop for ClientPlace {
    fn drop(&mut self) {
        drop(self.permit.take());
        self.clients.forget_if_idle(self.address);
    }
}

/// A request's place, in its extensions: the handler takes it for a write task
/// ([`HeldPlace::take`]); otherwise it is given back when the request has been answered.
#[derive(Clone)]
pub(crate) struct HeldPlace(Arc<Mutex<Option<ClientPlace>>>);

impl HeldPlace {
    /// The place, for a task that outlives the request; `None` if already taken.
    pub(crate) fn take(&self) -> Option<ClientPlace> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// A connection's service: each request waits for a place of its client, then goes to `inner`
/// (which takes a place of the proxy's `--max-in-flight`) and holds its place until `inner` has
/// answered (or hands it to a write task).
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

impl<S, B> tower::Service<http::Request<B>> for PerClient<S>
where
    S: tower::Service<http::Request<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is the inner service's, checked once this request has its client's place:
        // asking it here would take a place of the proxy's while the request waits for its own.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        let places = self.places.clone();
        Box::pin(async move {
            let held = HeldPlace(Arc::new(Mutex::new(Some(places.acquire().await))));
            let mut request = request;
            request.extensions_mut().insert(held.clone());
            let mut inner = inner;
            let answered = async {
                tower::ServiceExt::ready(&mut inner).await?;
                inner.call(request).await
            }
            .await;
            // Back now unless a write task took it (the request's copy may live on upstream).
            drop(held.take());
            answered
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tower::{Service, ServiceExt};

    /// A service that answers a request with body `true` only when `gate` is notified, and can
    /// take the request's place as a write task would (into `taken`).
    fn inner(
        gate: Arc<tokio::sync::Notify>,
        taken: Arc<Mutex<Vec<ClientPlace>>>,
    ) -> impl tower::Service<
        http::Request<(bool, bool)>,
        Response = bool,
        Error = std::convert::Infallible,
        Future = impl Send,
    > + Clone
    + Send
    + 'static {
        tower::service_fn(move |request: http::Request<(bool, bool)>| {
            let gate = gate.clone();
            let taken = taken.clone();
            async move {
                let (slow, take) = *request.body();
                if take {
                    let place = request.extensions().get::<HeldPlace>().unwrap().take();
                    taken.lock().unwrap().push(place.unwrap());
                }
                if slow {
                    gate.notified().await;
                }
                Ok::<_, std::convert::Infallible>(slow)
            }
        })
    }

    /// Goal: past its bound a client's requests wait for its own, while another address's go
    /// through; the table forgets an address once its last connection is gone.
    #[tokio::test]
    async fn a_client_waits_for_its_own_places_only() {
        let clients = ClientsInFlight::new(2);
        let gate = Arc::new(tokio::sync::Notify::new());
        let inner = inner(gate.clone(), Arc::default());
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let mut conn_a = PerClient::new(inner.clone(), clients.of(a));
        let mut conn_a2 = PerClient::new(inner.clone(), clients.of(a));
        let mut slow = Vec::new();
        for _ in 0..2 {
            let request = http::Request::new((true, false));
            slow.push(tokio::spawn(conn_a.ready().await.unwrap().call(request)));
        }
        tokio::task::yield_now().await;
        // A third request of the same address, on another connection, waits.
        let request = http::Request::new((false, false));
        let third = tokio::spawn(conn_a2.ready().await.unwrap().call(request));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !third.is_finished(),
            "past its bound a client's request went through"
        );
        // Another address is not held up.
        let mut conn_b = PerClient::new(inner.clone(), clients.of(b));
        let request = http::Request::new((false, false));
        let answered = tokio::time::timeout(
            Duration::from_secs(1),
            conn_b.ready().await.unwrap().call(request),
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

    /// Goal: a place taken by a write task counts against its client after the request was
    /// answered and after the connection closed (a client that resets its writes cannot leave
    /// more than its bound of tasks behind), and the address is forgotten once it is back.
    #[tokio::test]
    async fn a_place_taken_by_a_write_task_counts_until_the_task_ends() {
        let clients = ClientsInFlight::new(1);
        let taken = Arc::new(Mutex::new(Vec::new()));
        let inner = inner(Arc::default(), taken.clone());
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let mut conn = PerClient::new(inner.clone(), clients.of(a));
        let request = http::Request::new((false, true));
        conn.ready().await.unwrap().call(request).await.unwrap();
        assert_eq!(taken.lock().unwrap().len(), 1);
        drop(conn);
        // The connection is gone, the task's place is not: a new connection of the address
        // finds no place free.
        let mut conn = PerClient::new(inner.clone(), clients.of(a));
        let request = http::Request::new((false, false));
        let waiting = tokio::spawn(conn.ready().await.unwrap().call(request));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "a write task's place was free");
        taken.lock().unwrap().clear();
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("the place the task gave back was not given to the waiting request")
            .unwrap()
            .unwrap();
        drop(conn);
        assert_eq!(clients.addresses(), 0);
        // A task that ends after the last connection closed forgets the address itself.
        let mut conn = PerClient::new(inner.clone(), clients.of(a));
        let request = http::Request::new((false, true));
        conn.ready().await.unwrap().call(request).await.unwrap();
        drop(conn);
        assert_eq!(
            clients.addresses(),
            1,
            "forgotten while a task held a place"
        );
        taken.lock().unwrap().clear();
        assert_eq!(clients.addresses(), 0);
    }
}
