//! TLS (rustls with the ring provider) and client identities.
//!
//! Client certificates are optional at the handshake, so the health service
//! stays reachable without one; a certificate that is presented must chain
//! to the client CA and be valid now, or the handshake fails. Every other
//! service requires the identity (see `auth`). The identity of a connection
//! is read once, from the leaf certificate: its SPIFFE URI SAN, else its
//! first DNS SAN, else its subject CN.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::model::Identity;
use rustls::{
    RootCertStore, ServerConfig,
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::WebPkiClientVerifier,
};

/// Where the TLS material lives.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// Server certificate chain (PEM, leaf first).
    pub cert: PathBuf,
    /// Server private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA bundle that client certificates must chain to (PEM).
    pub client_ca: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum TlsError {
    #[error("cannot read {what} {path}: {error}")]
    Pem {
        what: &'static str,
        path: PathBuf,
        error: rustls::pki_types::pem::Error,
    },
    #[error("{path} holds no {what}")]
    Empty { what: &'static str, path: PathBuf },
    #[error("invalid TLS configuration: {0}")]
    Rustls(rustls::Error),
    #[error("invalid client CA bundle {path}: {error}")]
    ClientCa {
        path: PathBuf,
        error: rustls::server::VerifierBuilderError,
    },
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|error| TlsError::Pem {
            what,
            path: path.into(),
            error,
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.into(),
        });
    }
    Ok(certs)
}

/// Builds the rustls server configuration from the files (read now).
pub(crate) fn server_config(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = certs(&files.cert, "certificate")?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|error| TlsError::Pem {
        what: "private key",
        path: files.key.clone(),
        error,
    })?;
    let mut roots = RootCertStore::empty();
    let (_, ignored) = roots.add_parsable_certificates(certs(&files.client_ca, "CA certificate")?);
    if roots.is_empty() {
        return Err(TlsError::Empty {
            what: "usable CA certificate",
            path: files.client_ca.clone(),
        });
    }
    if ignored > 0 {
        tracing::warn!(path = %files.client_ca.display(), ignored, "some CA certificates could not be parsed");
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .allow_unauthenticated()
        .build()
        .map_err(|error| TlsError::ClientCa {
            path: files.client_ca.clone(),
            error,
        })?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(TlsError::Rustls)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The identity a client certificate (DER) names: SPIFFE URI SAN, else the
/// first DNS SAN, else the subject CN.
pub(super) fn identity_of(der: &[u8]) -> Option<Identity> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let mut dns = None;
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::URI(uri) if uri.starts_with("spiffe://") => {
                    return Some(Identity::Spiffe((*uri).into()));
                }
                GeneralName::DNSName(d) if dns.is_none() => dns = Some(Identity::Dns((*d).into())),
                _ => {}
            }
        }
    }
    dns.or_else(|| {
        cert.subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(|cn| Identity::Cn(cn.into()))
    })
}

/// How a connection is secured.
#[derive(Debug, Clone, Default)]
pub(crate) enum Transport {
    /// No TLS: every caller is anonymous.
    #[default]
    Plaintext,
    /// TLS, with the verified identity of the client certificate (none when
    /// the client presented no certificate).
    Tls {
        /// The client's identity.
        identity: Option<Identity>,
    },
    /// The Unix socket: a local process, as the kernel says.
    Unix {
        /// Its user.
        uid: u32,
        /// The process.
        pid: Option<u32>,
    },
}

/// The TLS configuration in force; replaced on reload.
pub(crate) type SharedTls = Arc<arc_swap::ArcSwap<ServerConfig>>;

#[cfg(test)]
mod tests {
    use rcgen::{CertificateParams, DnType, KeyPair, SanType};

    use super::*;

    fn cert(sans: Vec<SanType>, cn: Option<&str>) -> Vec<u8> {
        let mut p = CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.subject_alt_names = sans;
        if let Some(cn) = cn {
            p.distinguished_name.push(DnType::CommonName, cn);
        }
        let key = KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn identity_prefers_spiffe_then_dns_then_cn() {
        let spiffe = SanType::URI("spiffe://example.org/ops".try_into().unwrap());
        let other_uri = SanType::URI("https://example.org/x".try_into().unwrap());
        let dns = SanType::DnsName("ops.example.org".try_into().unwrap());
        let text = |der: Vec<u8>| identity_of(&der).map(|i| i.to_string());
        assert_eq!(
            text(cert(vec![dns.clone(), spiffe], Some("cn"))).as_deref(),
            Some("spiffe://example.org/ops")
        );
        assert_eq!(
            text(cert(vec![other_uri, dns], Some("cn"))).as_deref(),
            Some("dns:ops.example.org")
        );
        assert_eq!(
            text(cert(vec![], Some("alice"))).as_deref(),
            Some("cn:alice")
        );
        assert_eq!(
            text(cert(vec![], Some("spiffe://example.org/ops"))).as_deref(),
            Some("cn:spiffe://example.org/ops"),
            "a CN is a CN whatever it says"
        );
        assert_eq!(identity_of(&cert(vec![], None)), None);
        assert_eq!(identity_of(b"not a certificate"), None);
    }
}
