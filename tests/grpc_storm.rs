//! The storm over gRPC: 64 identical calls released together (a barrier), for each of 50 keys,
//! through real tonic clients against the real tonic server, on PostgreSQL in atomic mode.
//! Exactly one execution and one row per key; every other answer is the identical replay or
//! ABORTED (`idempotency_request_in_flight`).
#![cfg(all(feature = "grpc-example", feature = "postgres"))]

#[path = "support/grpc.rs"]
mod grpc;
mod support;

use tonic::Code;
use tower_idempotency::CouplingMode;

use grpc::{ThingsService, call, client, replayed, serve, thing};

const KEYS: usize = 50;
const DUPLICATES: usize = 64;
/// Keys stormed at the same time, each with all its duplicates.
const KEYS_AT_ONCE: usize = 4;
/// HTTP/2 connections the calls are spread over.
const CONNECTIONS: usize = 8;

/// What one call got: the message and whether it is a replay, or the refusal.
#[derive(Debug)]
enum Answer {
    Ok { thing: grpc::proto::Thing, replayed: bool, execution_metadata: Option<String> },
    Refused { code: Code, idempotency_code: Option<String> },
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_of_identical_calls_executes_once_per_key_and_every_other_answer_is_the_replay_or_aborted() {
    let store = support::pg_store(CouplingMode::Atomic).await;
    grpc::create_table(store.pool()).await;
    let service = ThingsService::new(store.pool().clone());
    let addr = serve(grpc::layer(store.clone()), service.clone()).await;
    let mut clients = Vec::new();
    for _ in 0..CONNECTIONS {
        clients.push(client(addr).await);
    }

    let answers = support::released_together(KEYS, DUPLICATES, KEYS_AT_ONCE, |k, d, barrier| {
        let key = format!("storm-key-{k}");
        let mut client = clients[(k * DUPLICATES + d) % CONNECTIONS].clone();
        async move {
            let request = call(thing(&key, 1000 + k as i64), Some("storm"), &[key.as_str()]);
            barrier.wait().await;
            let answer = match client.create(request).await {
                Ok(response) => Answer::Ok {
                    replayed: replayed(response.metadata()),
                    execution_metadata: response
                        .metadata()
                        .get("x-thing-execution")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned),
                    thing: response.into_inner(),
                },
                Err(status) => Answer::Refused {
                    code: status.code(),
                    idempotency_code: status
                        .metadata()
                        .get("idempotency-code")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned),
                },
            };
            (key, answer)
        }
    })
    .await;

    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT name, count(*) FROM things GROUP BY name")
        .fetch_all(store.pool())
        .await
        .expect("count rows");
    assert_eq!(rows.len(), KEYS, "every key created its row");
    assert!(rows.iter().all(|(_, n)| *n == 1), "some key created more than one row: {rows:?}");
    assert_eq!(service.executions("create"), KEYS as u64, "one execution per key");

    let mut aborted = 0;
    let mut replays = 0;
    for (key, answers) in &answers {
        assert_eq!(answers.len(), DUPLICATES);
        let executed: Vec<_> = answers
            .iter()
            .filter_map(|a| match a {
                Answer::Ok { thing, replayed: false, execution_metadata } => Some((thing, execution_metadata)),
                _ => None,
            })
            .collect();
        assert_eq!(executed.len(), 1, "{key}: exactly one answer is the execution");
        for answer in answers {
            match answer {
                Answer::Ok { replayed: false, .. } => {}
                Answer::Ok { thing, replayed: true, execution_metadata } => {
                    assert_eq!((thing, execution_metadata), executed[0], "{key}: replays are identical");
                    replays += 1;
                }
                Answer::Refused { code, idempotency_code } => {
                    assert_eq!(*code, Code::Aborted, "{key}: the only refusal is ABORTED, got {answer:?}");
                    assert_eq!(idempotency_code.as_deref(), Some("idempotency_request_in_flight"));
                    aborted += 1;
                }
            }
        }
    }
    println!("gRPC storm: {KEYS} keys x {DUPLICATES} calls: {} rows, {replays} replays, {aborted} ABORTED", rows.len());
}
