//! Certificates made at test time: a CA, a server certificate for
//! localhost/127.0.0.1, and client certificates of every kind the tests need.

use std::path::{Path, PathBuf};

use bpfmap_client::ClientTls;
use bpfmapd::TlsFiles;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, date_time_ymd,
};
use tempfile::TempDir;

/// How a client certificate names its holder.
#[derive(Debug, Clone, Copy)]
pub enum Name<'a> {
    Spiffe(&'a str),
    Dns(&'a str),
    Cn(&'a str),
}

/// When a certificate is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    Now,
    Expired,
    NotYetValid,
}

/// A certificate authority with files in a temporary directory.
#[derive(Debug)]
pub struct Pki {
    dir: TempDir,
    issuer: Issuer<'static, KeyPair>,
}

fn ca_params(name: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, name);
    p
}

impl Pki {
    /// A new CA ("ca.pem") and a server certificate ("server.pem",
    /// "server.key") for localhost and 127.0.0.1.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let key = KeyPair::generate().unwrap();
        let params = ca_params("bpfmapd test CA");
        let cert = params.self_signed(&key).unwrap();
        std::fs::write(dir.path().join("ca.pem"), cert.pem()).unwrap();
        let pki = Self {
            dir,
            issuer: Issuer::new(params, key),
        };
        let mut server =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        pki.issue(server, "server");
        pki
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    fn issue(&self, params: CertificateParams, stem: &str) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (c, k) = (
            self.path(&format!("{stem}.pem")),
            self.path(&format!("{stem}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }

    /// The server's TLS files: its certificate, and this CA for clients.
    pub fn server_files(&self) -> TlsFiles {
        TlsFiles {
            cert: self.path("server.pem"),
            key: self.path("server.key"),
            client_ca: self.path("ca.pem"),
        }
    }

    /// A client certificate; files `<stem>.pem` and `<stem>.key`.
    pub fn client(&self, stem: &str, name: Name<'_>, validity: Validity) -> ClientTls {
        let mut p = CertificateParams::default();
        p.distinguished_name = DistinguishedName::new();
        match name {
            Name::Spiffe(uri) => p.subject_alt_names = vec![SanType::URI(uri.try_into().unwrap())],
            Name::Dns(dns) => p.subject_alt_names = vec![SanType::DnsName(dns.try_into().unwrap())],
            Name::Cn(cn) => p.distinguished_name.push(DnType::CommonName, cn),
        }
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        match validity {
            Validity::Now => {}
            Validity::Expired => {
                p.not_before = date_time_ymd(2000, 1, 1);
                p.not_after = date_time_ymd(2001, 1, 1);
            }
            Validity::NotYetValid => {
                p.not_before = date_time_ymd(2090, 1, 1);
                p.not_after = date_time_ymd(2091, 1, 1);
            }
        }
        let (cert, key) = self.issue(p, stem);
        self.client_tls(&cert, &key)
    }

    /// TLS material for a client holding `cert`/`key`, trusting this CA.
    pub fn client_tls(&self, cert: &Path, key: &Path) -> ClientTls {
        ClientTls::from_files(&self.path("ca.pem"), cert, key).unwrap()
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}
