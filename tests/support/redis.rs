//! Redis servers and clusters that the tests start themselves, on free loopback ports.
//!
//! Each server is a `redis-server` child process (no persistence, its own temp dir), killed
//! and its dir removed on drop. A small `sh` watchdog beside each server kills it (by its pid)
//! and removes its dir when the test process is gone, so servers shared by a whole test binary
//! (in statics, never dropped) and servers of a test killed mid-way do not outlive the run.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tower_idempotency::{FastPath, Store};

/// A `redis-server` on a loopback port.
pub struct RedisServer {
    /// Its port.
    pub port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    process: Option<(Child, Child)>,
}

impl RedisServer {
    /// A plain server on a free port.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// A server on a free port with extra `redis-server` arguments (`["--maxmemory", "2mb"]`).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        Self::start_on(free_port(), extra)
    }

    fn start_on(port: u16, extra: &[&str]) -> RedisServer {
        let dir = std::env::temp_dir().join(super::unique_name("tidem_redis"));
        std::fs::create_dir_all(&dir).expect("a temp dir for redis-server");
        let mut server =
            RedisServer { port, dir, extra: extra.iter().map(|s| (*s).to_owned()).collect(), process: None };
        server.spawn();
        server
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// SIGKILL: the server dies at once, as in a crash.
    pub fn stop(&mut self) {
        if let Some((mut server, mut watchdog)) = self.process.take() {
            // The watchdog first, so it can never signal a pid the system has reused.
            let _ = watchdog.kill();
            let _ = watchdog.wait();
            let _ = server.kill();
            let _ = server.wait();
        }
    }

    /// Starts the server again on the same port (after [`stop`](Self::stop)): empty, no
    /// scripts loaded.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Runs `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    fn spawn(&mut self) {
        let port = self.port.to_string();
        let mut args: Vec<String> = [
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.push("--dir".into());
        args.push(self.dir.display().to_string());
        args.extend(self.extra.iter().cloned());
        let server = Command::new("redis-server")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start redis-server (is it installed? `apt-get install -y redis-server`)");
        let watchdog = watchdog(server.id(), &self.dir);
        self.process = Some((server, watchdog));
        wait_for_ping(self.port);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of three masters (no replicas) on loopback ports.
pub struct RedisCluster {
    /// The masters.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three cluster-enabled servers, joins them with `redis-cli --cluster create`, and
    /// waits until every node reports `cluster_state:ok`.
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                let port = free_cluster_port();
                RedisServer::start_on(
                    port,
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        &format!("nodes-{port}.conf"),
                        "--cluster-node-timeout",
                        "5000",
                    ],
                )
            })
            .collect();
        let addresses: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let mut create = vec!["--cluster", "create"];
        create.extend(addresses.iter().map(String::as_str));
        create.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        let output = redis_cli(nodes[0].port, &create);
        assert!(output.contains("[OK] All 16384 slots covered"), "cluster create failed: {output}");
        let deadline = Instant::now() + Duration::from_secs(30);
        for node in &nodes {
            while !node.cli(&["cluster", "info"]).contains("cluster_state:ok") {
                assert!(Instant::now() < deadline, "the cluster did not reach cluster_state:ok");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        RedisCluster { nodes }
    }

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}

/// One server for the whole test binary (tests isolate themselves with key prefixes).
pub fn shared_server() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(RedisServer::start)
}

/// One cluster for the whole test binary.
pub fn shared_cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

/// A key prefix no other test uses.
pub fn unique_prefix() -> String {
    super::unique_name("t")
}

/// The bound on each Redis call in tests: generous, so that a machine busy with other builds
/// does not turn a slow answer into a (correct, but uncounted-for) fall-back.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(1);

/// The fast path over `store` on the node at `url`, with a prefix of its own.
pub fn fast_path<S: Store>(store: S, url: &str) -> FastPath<S> {
    FastPath::connect(store, url).expect("redis URL").prefix(&unique_prefix()).expect("prefix").timeout(TEST_TIMEOUT)
}

/// The fast path over `store` on the shared cluster, with a prefix of its own.
pub fn cluster_fast_path<S: Store>(store: S) -> FastPath<S> {
    let urls = shared_cluster().urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    FastPath::connect_cluster(store, &urls)
        .expect("cluster URLs")
        .prefix(&unique_prefix())
        .expect("prefix")
        .timeout(TEST_TIMEOUT)
}

/// The Redis key of `id`'s cached response (`kind` `'c'`) or lock (`'l'`) under `prefix`, in
/// whatever namespace the deployment's secret gave it: the tests do not know the secret, and
/// their prefixes are their own. `None` when there is no such key.
pub fn find_key(server: &RedisServer, prefix: &str, id: &tower_idempotency::RecordId, kind: char) -> Option<String> {
    let pattern = format!("{prefix}:*:{{{}}}:{kind}", id.to_hex());
    let found = server.cli(&["--scan", "--pattern", &pattern]);
    let mut keys = found.lines().map(str::trim).filter(|key| !key.is_empty());
    let key = keys.next().map(str::to_owned);
    assert!(keys.next().is_none(), "one deployment, one key: {found}");
    key
}

/// The namespace segment of the fast path's keys under `prefix`: what follows `prefix:`, up to
/// the identity's hash tag. `None` when there is no key under `prefix`.
pub fn namespace_of(server: &RedisServer, prefix: &str) -> Option<String> {
    let found = server.cli(&["--scan", "--pattern", &format!("{prefix}:*")]);
    let key = found.lines().map(str::trim).find(|key| !key.is_empty())?;
    let rest = key.strip_prefix(&format!("{prefix}:"))?;
    Some(rest.split(":{").next()?.to_owned())
}

/// Runs `redis-cli -p <port> <args>` and returns its stdout (and stderr, for messages).
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .arg("-h")
        .arg("127.0.0.1")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("run redis-cli");
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    text
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A free port whose cluster bus port (+10000) is free too.
fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port < 55000 && std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

/// Kills `pid` and removes `dir` once this test process is gone (checked every second).
fn watchdog(pid: u32, dir: &Path) -> Child {
    let script = format!(
        "while kill -0 {me} 2>/dev/null && kill -0 {pid} 2>/dev/null; do sleep 1; done; \
         if ! kill -0 {me} 2>/dev/null; then kill -9 {pid} 2>/dev/null; rm -rf '{dir}'; fi",
        me = std::process::id(),
        dir = dir.display(),
    );
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the redis-server watchdog")
}

fn wait_for_ping(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if ping(port) {
            return;
        }
        assert!(Instant::now() < deadline, "redis-server on port {port} did not answer PING");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut reply = [0u8; 7];
    stream.read_exact(&mut reply).is_ok() && &reply == b"+PONG\r\n"
}

/// A TCP proxy in front of a Redis server that can hold back the server's replies: requests
/// reach the server at once (so a script runs), but the client sees no answer until
/// [`release`](Self::release). What a client sees when it gives up on a slow Redis, on demand.
pub struct GatedProxy {
    /// The proxy's port.
    pub port: u16,
    open: tokio::sync::watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl GatedProxy {
    /// A proxy to the server on `upstream`, open (replies pass). Call it on a Tokio runtime.
    pub async fn start(upstream: u16) -> GatedProxy {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let port = listener.local_addr().expect("addr").port();
        let (open, _) = tokio::sync::watch::channel(true);
        let gate = open.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else { continue };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                let mut gate = gate.subscribe();
                tokio::spawn(async move {
                    let mut buffer = vec![0u8; 16 * 1024];
                    loop {
                        let Ok(n) = server_read.read(&mut buffer).await else { return };
                        if n == 0 {
                            return;
                        }
                        if gate.wait_for(|open| *open).await.is_err() {
                            return;
                        }
                        if client_write.write_all(&buffer[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        GatedProxy { port, open, accept }
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Holds back every reply from now on.
    pub fn hold(&self) {
        self.open.send_replace(false);
    }

    /// Lets the replies through again (those held first).
    pub fn release(&self) {
        self.open.send_replace(true);
    }
}

impl Drop for GatedProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Waits, polling, until `done` holds; panics after `bound` (a liveness bound, not a timing
/// claim: what it waits for happens in milliseconds when all is well).
pub async fn eventually(bound: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + bound;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: still not so after {bound:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A raw connection to the server at `url`, to read and write the fast path's keys as an
/// attacker with access to Redis would.
pub async fn raw_connection(url: &str) -> ::redis::aio::MultiplexedConnection {
    ::redis::Client::open(url).expect("redis URL").get_multiplexed_async_connection().await.expect("connect to Redis")
}
