//! A 3-node RabbitMQ cluster (the MQTT plugin, Debian's `rabbitmq-server` package) on 127.0.0.1,
//! started as child processes of the test: each node a `beam.smp` whose pid we hold, with its own
//! node name, ports chosen at run time, data and log directories under one temp dir, one Erlang
//! cookie (in a `HOME` of its own) and a private `epmd` on its own port, so nothing under `/etc`
//! or the user's home is touched and two runs never meet.
//!
//! Nodes 2 and 3 find node 1 through `classic_config` peer discovery and join it as they boot (no
//! `rabbitmqctl join_cluster` round trips), one after the other. A node is ready when its MQTT
//! port accepts connections; the cluster, when node 1 reports three nodes online. Every process
//! is killed and reaped when the cluster is dropped (a failed test included).
//!
//! RabbitMQ's MQTT plugin (3.10) speaks MQTT 3.1.1 only and keeps a persistent subscriber's
//! session as a queue `mqtt-subscription-<client id>qos1`: a classic queue on the node the
//! subscriber first connected to (gone with that node), or a quorum queue replicated over the
//! three (`Queues::Quorum`).

use std::fs;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";
const CTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";
const EPMD: &str = "/usr/bin/epmd";

/// A node's boot, on a busy 2-core machine, stays well under this.
const BOOT_LIMIT: Duration = Duration::from_secs(180);

/// Where a persistent subscriber's session lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queues {
    /// `mqtt.durable_queue_type = classic`: on one node, lost with it.
    Classic,
    /// `mqtt.durable_queue_type = quorum`: replicated over a majority of nodes.
    Quorum,
}

/// Why a cluster cannot start here, if it cannot: the package is not installed.
pub fn unavailable() -> Option<String> {
    [SERVER, CTL, EPMD]
        .iter()
        .find(|p| !Path::new(p).exists())
        .map(|p| format!("{p} is missing: install Debian's rabbitmq-server package"))
}

struct Node {
    name: String,
    mqtt: u16,
    dir: PathBuf,
    env: Vec<(String, String)>,
    process: Option<Child>,
}

/// Three nodes and their epmd; all killed on drop.
pub struct RabbitCluster {
    dir: tempfile::TempDir,
    epmd_port: u16,
    epmd: Option<Child>,
    nodes: Vec<Node>,
}

fn accepts(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

impl RabbitCluster {
    /// Starts the three nodes and returns once each accepts MQTT connections.
    pub fn start(queues: Queues) -> io::Result<RabbitCluster> {
        if let Some(why) = unavailable() {
            return Err(io::Error::other(why));
        }
        let dir = tempfile::Builder::new().prefix("edge-outbox-rabbit-").tempdir()?;
        let home = dir.path().join("home");
        fs::create_dir_all(&home)?;
        let cookie = home.join(".erlang.cookie");
        fs::write(
            &cookie,
            edge_outbox::MessageId::new_v7().to_string().replace('-', ""),
        )?;
        fs::set_permissions(&cookie, fs::Permissions::from_mode(0o400))?;
        let ports = super::ports::reserve(10)?;
        let epmd_port = ports[9];
        let mut cluster = RabbitCluster {
            epmd_port,
            epmd: None,
            nodes: Vec::new(),
            dir,
        };
        cluster.epmd = Some(
            Command::new(EPMD)
                .args(["-port", &epmd_port.to_string(), "-address", "127.0.0.1"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?,
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while !accepts(epmd_port) {
            if Instant::now() > deadline {
                return Err(io::Error::other("epmd did not start"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let first = "rabbit1@localhost".to_owned();
        for i in 0..3 {
            let (amqp, dist, mqtt) = (ports[3 * i], ports[3 * i + 1], ports[3 * i + 2]);
            let name = format!("rabbit{}@localhost", i + 1);
            let node_dir = cluster.dir.path().join(format!("n{}", i + 1));
            fs::create_dir_all(node_dir.join("mnesia"))?;
            fs::create_dir_all(node_dir.join("log"))?;
            fs::write(node_dir.join("enabled_plugins"), "[rabbitmq_mqtt].\n")?;
            let mut conf = format!(
                "listeners.tcp.default = 127.0.0.1:{amqp}\n\
                 mqtt.listeners.tcp.default = 127.0.0.1:{mqtt}\n\
                 mqtt.allow_anonymous = true\n\
                 mqtt.default_user = guest\n\
                 mqtt.default_pass = guest\n\
                 log.console = false\n\
                 log.file.level = info\n"
            );
            if queues == Queues::Quorum {
                conf.push_str("mqtt.durable_queue_type = quorum\n");
            }
            if i > 0 {
                // Retry for as long as a boot may take.
                conf.push_str(&format!(
                    "cluster_formation.peer_discovery_backend = classic_config\n\
                     cluster_formation.classic_config.nodes.1 = {first}\n\
                     cluster_formation.discovery_retry_limit = 720\n\
                     cluster_formation.discovery_retry_interval = 250\n"
                ));
            }
            fs::write(node_dir.join("rabbitmq.conf"), conf)?;
            let path = |p: &str| node_dir.join(p).to_string_lossy().into_owned();
            let env = vec![
                ("HOME".into(), home.to_string_lossy().into_owned()),
                ("ERL_EPMD_PORT".into(), epmd_port.to_string()),
                // Not the package's /etc/rabbitmq/rabbitmq-env.conf.
                ("RABBITMQ_CONF_ENV_FILE".into(), "/nonexistent".into()),
                ("RABBITMQ_NODENAME".into(), name.clone()),
                ("RABBITMQ_NODE_IP_ADDRESS".into(), "127.0.0.1".into()),
                ("RABBITMQ_NODE_PORT".into(), amqp.to_string()),
                ("RABBITMQ_DIST_PORT".into(), dist.to_string()),
                ("RABBITMQ_CONFIG_FILE".into(), path("rabbitmq.conf")),
                ("RABBITMQ_ADVANCED_CONFIG_FILE".into(), path("advanced.config")),
                ("RABBITMQ_MNESIA_BASE".into(), path("mnesia")),
                ("RABBITMQ_LOG_BASE".into(), path("log")),
                ("RABBITMQ_ENABLED_PLUGINS_FILE".into(), path("enabled_plugins")),
                ("RABBITMQ_ALLOW_INPUT".into(), "1".into()),
                // Unbound schedulers boot faster on a small shared machine.
                ("RABBITMQ_SCHEDULER_BIND_TYPE".into(), "u".into()),
                (
                    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS".into(),
                    "-noinput -kernel inet_dist_use_interface {127,0,0,1}".into(),
                ),
            ];
            cluster.nodes.push(Node {
                name,
                mqtt,
                dir: node_dir,
                env,
                process: None,
            });
        }
        // One at a time: RabbitMQ 3.10's MQTT plugin can stall for about 100 s when two nodes
        // join a cluster at the same moment.
        for i in 0..3 {
            cluster.spawn(i)?;
            cluster.wait_ready(i)?;
        }
        // Ready one by one is not yet one cluster: a node that missed node 1 would boot alone.
        cluster.ctl(0, &["await_online_nodes", "3", "--timeout", "60"])?;
        eprintln!(
            "support: RabbitMQ cluster, MQTT on {:?}, pids {:?}, dir {}",
            cluster.nodes.iter().map(|n| n.mqtt).collect::<Vec<_>>(),
            cluster.pids(),
            cluster.dir.path().display()
        );
        Ok(cluster)
    }

    fn spawn(&mut self, i: usize) -> io::Result<()> {
        let node = &mut self.nodes[i];
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.dir.join("stdout.log"))?;
        // rabbitmq-server execs erl, which execs beam.smp: this pid is the node's.
        node.process = Some(
            Command::new(SERVER)
                .current_dir(&node.dir)
                .envs(node.env.iter().map(|(k, v)| (k, v)))
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()?,
        );
        Ok(())
    }

    fn wait_ready(&mut self, i: usize) -> io::Result<()> {
        let deadline = Instant::now() + BOOT_LIMIT;
        loop {
            if accepts(self.nodes[i].mqtt) {
                return Ok(());
            }
            let node = &mut self.nodes[i];
            let died = match node.process.as_mut() {
                Some(p) => p.try_wait()?.is_some(),
                None => true,
            };
            if died || Instant::now() > deadline {
                let log = fs::read_to_string(node.dir.join("stdout.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                return Err(io::Error::other(format!(
                    "RabbitMQ node {} {} (see {}):\n{}",
                    node.name,
                    if died {
                        "died while booting"
                    } else {
                        "did not boot in time"
                    },
                    node.dir.display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Node `i`'s MQTT address (0-based).
    pub fn mqtt_addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.nodes[i].mqtt))
    }

    /// The three MQTT addresses, node 1 first.
    pub fn mqtt_addrs(&self) -> Vec<SocketAddr> {
        (0..self.nodes.len()).map(|i| self.mqtt_addr(i)).collect()
    }

    /// The running nodes' pids.
    pub fn pids(&self) -> Vec<Option<u32>> {
        self.nodes
            .iter()
            .map(|n| n.process.as_ref().map(Child::id))
            .collect()
    }

    /// SIGKILL node `i`: it dies at once, as in a crash.
    pub fn kill(&mut self, i: usize) -> io::Result<()> {
        if let Some(mut p) = self.nodes[i].process.take() {
            // Already dead is fine: what matters is that it is reaped.
            let _ = p.kill();
            p.wait()?;
        }
        Ok(())
    }

    /// Starts node `i` again with its data, and waits until it accepts MQTT connections.
    pub fn restart(&mut self, i: usize) -> io::Result<()> {
        self.kill(i)?;
        self.spawn(i)?;
        self.wait_ready(i)
    }

    /// `rabbitmqctl` against node `i`: its output.
    pub fn ctl(&self, i: usize, args: &[&str]) -> io::Result<String> {
        let node = &self.nodes[i];
        let out = Command::new(CTL)
            .args(["-q", "-n", &node.name])
            .args(args)
            .env("HOME", self.dir.path().join("home"))
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("RABBITMQ_CONF_ENV_FILE", "/nonexistent")
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "rabbitmqctl {args:?} on {}: {}",
                node.name,
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The node (0-based) holding the queue of the persistent MQTT session `client_id`: a quorum
    /// queue's leader, a classic queue's home. Asked of the first running node.
    pub fn session_node(&self, client_id: &str) -> io::Result<Option<usize>> {
        let ask = (0..self.nodes.len())
            .find(|i| self.nodes[*i].process.is_some())
            .ok_or_else(|| io::Error::other("no node running"))?;
        let out = self.ctl(
            ask,
            &[
                "list_queues",
                "name",
                "type",
                "leader",
                "pid",
                "--no-table-headers",
            ],
        )?;
        let queue = format!("mqtt-subscription-{client_id}qos1");
        for line in out.lines() {
            let cols: Vec<&str> = line.split('\t').collect();
            if cols.first() != Some(&queue.as_str()) {
                continue;
            }
            // Quorum: the leader's name; classic: a pid like <rabbit2@localhost.123.45.0>.
            let holder = match cols.get(1) {
                Some(&"quorum") => cols.get(2).copied().unwrap_or(""),
                _ => cols.get(3).copied().unwrap_or(""),
            };
            return Ok(self
                .nodes
                .iter()
                .position(|n| holder.trim_start_matches('<').starts_with(&n.name)));
        }
        Ok(None)
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut p) = node.process.take() {
                let _ = p.kill();
                let _ = p.wait();
            }
        }
        if let Some(mut epmd) = self.epmd.take() {
            let _ = epmd.kill();
            let _ = epmd.wait();
        }
    }
}
