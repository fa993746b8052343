//! `edge-outbox send-command` and `encode-command`: a command for a device, built from JSON, as
//! docs/wire-format.md ("Sending a command") describes it.

use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use edge_outbox::{Envelope, MessageId};
use serde_json::json;

use crate::broker_args::BrokerArgs;
use crate::exit::CliError;
use crate::{Global, Result, output};

/// What the command is: the same options for both commands.
#[derive(Debug, Args)]
pub struct CommandArgs {
    /// The ordering key: commands with the same key are applied in the order they arrive, one
    /// at a time (use the thing they act on: a pump, an account).
    #[arg(long, value_name = "KEY")]
    pub key: String,
    /// The payload as JSON text (it is sent as CBOR: numbers, strings, arrays, objects).
    #[arg(long, value_name = "JSON")]
    pub payload: String,
    /// The message id (a UUID) [default: a new UUIDv7]. When you send a command again after a
    /// failure, send it with the same id: the device applies an id once.
    #[arg(long, value_name = "UUID", conflicts_with = "id_from")]
    pub id: Option<String>,
    /// Derive the id from this text (a request id of yours), so sending the same request again
    /// gives the same id (UUIDv5, see docs/wire-format.md).
    #[arg(long, value_name = "TEXT")]
    pub id_from: Option<String>,
    /// The command type (envelope `type`), e.g. SetRate.v1.
    #[arg(long = "type", value_name = "TYPE")]
    pub event_type: Option<String>,
    /// A text header, NAME=VALUE (repeatable).
    #[arg(long = "header", value_name = "NAME=VALUE")]
    pub headers: Vec<String>,
}

#[derive(Debug, Args)]
pub struct SendArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Client certificate chain (PEM) for mutual TLS (mqtts only; with --client-key).
    #[arg(long, value_name = "FILE", requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS (with --client-cert).
    #[arg(long, value_name = "FILE", requires = "client_cert")]
    pub client_key: Option<PathBuf>,
    /// The device's command topic to publish on (QoS 1).
    #[arg(long, value_name = "TOPIC")]
    pub topic: String,
    #[command(flatten)]
    pub command: CommandArgs,
    /// MQTT client id of this sender [default: edge-outbox-send-<pid>]; never a device's.
    #[arg(long, value_name = "ID")]
    pub client_id: Option<String>,
    /// Seconds to wait for the broker's acknowledgement.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct EncodeArgs {
    #[command(flatten)]
    pub command: CommandArgs,
    /// Write lowercase hex and a newline instead of the CBOR bytes.
    #[arg(long)]
    pub hex: bool,
}

impl CommandArgs {
    fn envelope(&self) -> Result<Envelope<'static>> {
        let id = match (&self.id, &self.id_from) {
            (Some(id), _) => id
                .parse::<MessageId>()
                .map_err(|e| CliError::usage(format!("--id: {e}")))?,
            (None, Some(text)) => MessageId::from_key(text),
            (None, None) => MessageId::new_v7(),
        };
        let payload: serde_json::Value = serde_json::from_str(&self.payload)
            .map_err(|e| CliError::usage(format!("--payload is not valid JSON: {e}")))?;
        let mut envelope = Envelope::command(id, &self.key, &payload)?;
        envelope.event_type = self.event_type.clone().map(Into::into);
        for header in &self.headers {
            let (name, value) = header
                .split_once('=')
                .ok_or_else(|| CliError::usage(format!("--header {header:?}: expected NAME=VALUE")))?;
            envelope.headers.retain(|(n, _)| n != name);
            envelope
                .headers
                .push((name.to_owned().into(), value.to_owned().into()));
        }
        Ok(envelope)
    }
}

pub fn send(global: &Global, args: &SendArgs) -> Result<()> {
    let client_id = args
        .client_id
        .clone()
        .unwrap_or_else(|| format!("edge-outbox-send-{}", std::process::id()));
    let client_auth = args.client_cert.as_deref().zip(args.client_key.as_deref());
    let mqtt = args.broker.mqtt(client_auth)?.client_id(client_id);
    let envelope = args.command.envelope()?;
    edge_outbox::send_command(&mqtt, &args.topic, &envelope, Duration::from_secs(args.timeout))?;
    let id = envelope.id.to_string();
    if global.json {
        output::print_json(&json!({
            "id": id,
            "topic": args.topic,
            "key": args.command.key,
            "bytes": envelope.encode().len(),
        }))
    } else {
        output::print(&format!(
            "sent command {id} on {} (key {}); the broker acknowledged it\n",
            args.topic, args.command.key
        ))
    }
}

pub fn encode(args: &EncodeArgs) -> Result<()> {
    let bytes = args.command.envelope()?.encode();
    if args.hex {
        return output::print(&format!("{}\n", crate::decode::hex(&bytes)));
    }
    let mut out = std::io::stdout().lock();
    if out.is_terminal() {
        return Err(CliError::usage(
            "refusing to write CBOR bytes to a terminal: redirect to a file or a pipe, or use --hex",
        ));
    }
    out.write_all(&bytes)
        .and_then(|()| out.flush())
        .map_err(|e| CliError::output(&e))
}
