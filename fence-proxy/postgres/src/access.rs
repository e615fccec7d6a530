//! Who may use the Postgres front end: TLS on the client side (`--tls-cert`, `--tls-key`,
//! `--tls-client-ca`, `--require-tls`) and the client networks (`--allow-client`).

use std::path::PathBuf;
use std::sync::Arc;

use fence_proxy_net::{AllowList, ReloadableServerConfig, ServerTlsFiles};
use ipnet::IpNet;

/// Flags of `fence-proxy postgres` about client access; `Default` is the open proxy of old:
/// no TLS, any address.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AccessArgs {
    /// PEM certificate chain the proxy presents to clients that send an SSLRequest (libpq's
    /// sslmode=prefer and stronger); with --tls-key. Without it the proxy answers `N` and speaks
    /// plain text only.
    #[arg(
        long,
        value_name = "FILE",
        env = "FENCE_PROXY_PG_TLS_CERT",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(
        long,
        value_name = "FILE",
        env = "FENCE_PROXY_PG_TLS_KEY",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// Require of every client a certificate issued by this PEM CA (mutual TLS); implies
    /// --require-tls, so a client cannot skip the check by not asking for TLS. The upstream
    /// still authenticates the role as its pg_hba.conf says.
    #[arg(
        long,
        value_name = "FILE",
        env = "FENCE_PROXY_PG_TLS_CLIENT_CA",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// Refuse (FATAL 28000) a client that starts a session without TLS. Needs --tls-cert.
    #[arg(long, env = "FENCE_PROXY_PG_REQUIRE_TLS", requires = "tls_cert")]
    pub require_tls: bool,
    /// Serve only clients from this network (CIDR such as 10.0.0.0/8, or one address);
    /// repeatable. Others are refused (FATAL 28000) before any upstream connection. Default:
    /// every address.
    #[arg(long = "allow-client", value_name = "CIDR", env = "FENCE_PROXY_PG_ALLOW_CLIENT",
          value_delimiter = ',', value_parser = fence_proxy_net::allow::parse_cidr)]
    pub allow_client: Vec<IpNet>,
}

impl AccessArgs {
    /// The TLS configuration for clients, when a certificate is configured; reloadable, read at
    /// each SSLRequest.
    pub fn server_tls(&self) -> anyhow::Result<Option<Arc<ReloadableServerConfig>>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            anyhow::ensure!(
                !self.require_tls,
                "--require-tls needs --tls-cert and --tls-key"
            );
            return Ok(None);
        };
        let config = ReloadableServerConfig::load(ServerTlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: self.tls_client_ca.clone(),
            alpn: Vec::new(),
        })?;
        Ok(Some(config))
    }

    /// Whether a session must start with TLS: `--require-tls`, or `--tls-client-ca` (a client
    /// certificate check that a plaintext session could skip would be no check).
    pub fn tls_required(&self) -> bool {
        self.require_tls || self.tls_client_ca.is_some()
    }

    /// The `--allow-client` networks.
    pub fn allow_list(&self) -> AllowList {
        AllowList::new(self.allow_client.clone())
    }
}
