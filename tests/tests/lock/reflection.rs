//! gRPC server reflection: a generic client (grpcurl, Evans, Postman) lists lockd's public
//! services and fetches their schema from any node with no .proto file; the internal Raft
//! service stays unlisted.

use lockd_tests::cluster::Cluster;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};

async fn ask(cluster: &Cluster, node: u64, request: MessageRequest) -> MessageResponse {
    let mut client = ServerReflectionClient::new(cluster.channel(node).await.unwrap());
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    };
    let mut replies = client
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let reply: ServerReflectionResponse = replies.message().await.unwrap().expect("one reply");
    reply.message_response.expect("a response")
}

/// Goal: `grpcurl -plaintext HOST:PORT list` and `describe` work against every node. Method:
/// the reflection protocol grpcurl speaks, on a follower and on the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_lists_its_public_services_and_serves_their_schema() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    for node in [leader, (1..=3).find(|i| *i != leader).unwrap()] {
        let MessageResponse::ListServicesResponse(list) =
            ask(&cluster, node, MessageRequest::ListServices(String::new())).await
        else {
            panic!("not a service list");
        };
        let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
        for want in ["lockd.v1.Lock", "lockd.v1.Cluster", "grpc.health.v1.Health"] {
            assert!(names.contains(&want), "node {node} lists {names:?}");
        }
        assert!(
            !names.iter().any(|n| n.contains("raft")),
            "the internal Raft service is listed: {names:?}"
        );

        let MessageResponse::FileDescriptorResponse(files) = ask(
            &cluster,
            node,
            MessageRequest::FileContainingSymbol("lockd.v1.Lock".into()),
        )
        .await
        else {
            panic!("no descriptor for lockd.v1.Lock");
        };
        let all: Vec<u8> = files.file_descriptor_proto.concat();
        let text = String::from_utf8_lossy(&all);
        assert!(
            text.contains("Acquire") && text.contains("fencing_token"),
            "descriptor without the Lock service's methods"
        );
    }
}
