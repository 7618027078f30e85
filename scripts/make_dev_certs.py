"""A development CA and the certificates of one ddtree-serve deployment (docs/security.md), with `cryptography`:

    python scripts/make_dev_certs.py DIR [--name HOST ...] [--days N]

writes into DIR (made if missing; existing files are kept unless --force):
    ca.crt, ca.key              the deployment CA: every service and client trusts it
    gateway.crt, gateway.key    the gateway's public port (--tls-cert/--tls-key): localhost, 127.0.0.1, ::1,
                                `gateway` and each --name
    internal.crt, internal.key  every service's certificate for internal calls (--internal-cert/--internal-key),
                                as server and as client, for the name `ddtree-internal` that internal calls check
    client.crt, client.key      a client's certificate, for a gateway that verifies them (--tls-client-ca)
Keys are ECDSA P-256, readable by their owner only. For development and tests: a production CA key lives elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

INTERNAL_SERVER_NAME = "ddtree-internal"  # NOTE: proto/security.py's; this script runs without the project
Key = ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ddtree-serve development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alt_names(names: list[str]) -> x509.SubjectAlternativeName:
    def entry(name: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            return x509.DNSName(name)
    return x509.SubjectAlternativeName([entry(name) for name in names])


def _build(subject: str, key: Key, issuer: x509.Certificate | None, issuer_key: Key | None,
           days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject))
            .issuer_name(issuer.subject if issuer else _name(subject)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key((issuer_key or key).public_key()),
                           critical=False))


def make_ca(common_name: str, days: int) -> tuple[x509.Certificate, Key]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_build(common_name, key, None, None, days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(ca: x509.Certificate, ca_key: Key, common_name: str, names: list[str], server: bool, client: bool,
          days: int) -> tuple[x509.Certificate, Key]:
    """A leaf certificate for `names` (DNS names or IP addresses), for TLS servers and/or clients."""
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
    builder = (_build(common_name, key, ca, ca_key, days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if names:
        builder = builder.add_extension(_alt_names(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def write(directory: Path, stem: str, cert: x509.Certificate, key: Key) -> None:
    (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file = directory / f"{stem}.key"
    key_file.touch(mode=0o600)
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_dev_certs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--name", action="append", default=[],
                        help="another DNS name or IP address of the gateway (repeatable)")
    parser.add_argument("--days", type=int, default=365, help="validity of every certificate")
    parser.add_argument("--force", action="store_true", help="replace certificates already in DIR")
    args = parser.parse_args(argv)
    stems = ("ca", "gateway", "internal", "client")
    taken = [str(args.directory / f"{stem}.{kind}") for stem in stems for kind in ("crt", "key")
             if (args.directory / f"{stem}.{kind}").exists()]
    if taken and not args.force:
        parser.error(f"{', '.join(taken)} exist (--force replaces them)")
    args.directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = make_ca("ddtree-serve development CA", args.days)
    write(args.directory, "ca", ca, ca_key)
    gateway_names = ["localhost", "127.0.0.1", "::1", "gateway", *args.name]
    write(args.directory, "gateway", *issue(ca, ca_key, "gateway", gateway_names, True, False, args.days))
    write(args.directory, "internal", *issue(ca, ca_key, INTERNAL_SERVER_NAME, [INTERNAL_SERVER_NAME], True, True,
                                             args.days))
    write(args.directory, "client", *issue(ca, ca_key, "ddtree-client", [], False, True, args.days))
    print(f"wrote {', '.join(f'{stem}.crt/.key' for stem in stems)} into {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
