"""What a stack that listens beyond loopback needs: TLS, SCRAM users, and what a job gets.

Off loopback the broker's client listener is SASL_SSL: TLS with a certificate signed by
the stack's own CA (or one the operator gives with ``--tls-cert/--tls-key/--tls-ca``),
and SASL/SCRAM-SHA-512 with three users:

- ``admin``: the stack itself (its consumers, topic set-up); the only super user;
- ``writer``: what a training job gets: may only produce to the record topics;
- ``reader``: for consumers run elsewhere: may read the topics and use consumer groups.

Everything lives in ``<stack dir>/security`` with mode 0600: the CA (its key never
leaves), the broker's key and certificate, and the passwords. A job needs the env lines
:meth:`StackSecrets.client_env` gives and one file, ``ca.pem``.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

USERS = ("admin", "writer", "reader")
SCRAM = "SCRAM-SHA-512"


def _write_private(path: Path, data: bytes) -> None:
    """Written with mode 0600 from the start (no moment when others may read it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)


@dataclass
class StackSecrets:
    directory: Path
    passwords: dict[str, str]

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def broker_keystore(self) -> Path:
        """The broker's private key (PKCS#8) and certificate chain, PEM, as Kafka reads it."""
        return self.directory / "broker.pem"

    @classmethod
    def ensure(cls, directory: Path, hosts: list[str], tls_cert: Path | None = None,
               tls_key: Path | None = None, tls_ca: Path | None = None) -> "StackSecrets":
        """The stack's secrets, made once (kept across restarts: the nodes keep their CA
        file and passwords)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        passwords_file = directory / "passwords.json"
        if passwords_file.exists():
            passwords = json.loads(passwords_file.read_text())
        else:
            passwords = {user: secrets.token_urlsafe(24) for user in USERS}
            _write_private(passwords_file, json.dumps(passwords, indent=1).encode())
        made = cls(directory, passwords)
        if tls_cert is not None:
            if tls_key is None or tls_ca is None:
                raise ValueError("--tls-cert needs --tls-key and --tls-ca")
            made._take_given(Path(tls_cert), Path(tls_key), Path(tls_ca))
        elif not made.broker_keystore.exists():
            made._make_certificates(hosts)
        elif (directory / "ca.key").exists() and not made._covers(hosts):
            # Made here for other hosts (a new --listen or --public-host): a certificate
            # for these, signed by the same CA, so the nodes keep their CA file.
            made._make_certificates(hosts)
        return made

    def _covers(self, hosts: list[str]) -> bool:
        """Whether the broker's certificate names every one of ``hosts``."""
        from cryptography import x509

        try:
            cert = x509.load_pem_x509_certificate(self.broker_keystore.read_bytes())
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except (ValueError, x509.ExtensionNotFound):
            return False
        ips = set(san.get_values_for_type(x509.IPAddress))
        dns = {name.lower() for name in san.get_values_for_type(x509.DNSName)}
        for host in hosts:
            try:
                if ipaddress.ip_address(host) not in ips:
                    return False
            except ValueError:
                if host.lower() not in dns:
                    return False
        return True

    @staticmethod
    def load_given(cert: Path, key: Path, ca: Path):
        """The operator's private key, after checking the three files are what Kafka needs;
        ValueError naming the option and file otherwise."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        def read(option: str, path: Path) -> bytes:
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{option} {path}: {exc.strerror or exc}") from None

        for option, path in (("--tls-cert", cert), ("--tls-ca", ca)):
            pem = read(option, path)
            try:
                x509.load_pem_x509_certificate(pem)
            except ValueError:
                raise ValueError(f"{option} {path} is not a PEM certificate") from None
        pem = read("--tls-key", key)
        try:
            return serialization.load_pem_private_key(pem, password=None)
        except TypeError:  # cryptography: "Password was not given but private key is encrypted"
            raise ValueError(f"--tls-key {key} is encrypted: the broker starts unattended, give it "
                             f"the key without a passphrase (openssl pkey -in {key} -out KEY)") from None
        except ValueError:
            raise ValueError(f"--tls-key {key} is not a PEM private key") from None

    def _take_given(self, cert: Path, key: Path, ca: Path) -> None:
        from cryptography.hazmat.primitives import serialization

        private = self.load_given(cert, key, ca)
        pkcs8 = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())
        _write_private(self.broker_keystore, pkcs8 + cert.read_bytes())
        shutil.copyfile(ca, self.ca_file)
        (self.directory / "ca.key").unlink(missing_ok=True)  # (a CA of ours no longer in use)

    def _make_certificates(self, hosts: list[str]) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.timezone.utc)
        ca_key_file = self.directory / "ca.key"
        if ca_key_file.exists() and self.ca_file.exists():  # a new certificate, the same CA
            ca_key = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
            ca = x509.load_pem_x509_certificate(self.ca_file.read_bytes())
            ca_name = ca.subject
        else:
            ca_key = ec.generate_private_key(ec.SECP256R1())
            ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainmon stack CA")])
            ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
                  .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                  .not_valid_before(now - datetime.timedelta(minutes=5))
                  .not_valid_after(now + datetime.timedelta(days=3650))
                  .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                  .sign(ca_key, hashes.SHA256()))
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=825))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .sign(ca_key, hashes.SHA256()))
        pem = serialization.Encoding.PEM
        _write_private(self.directory / "ca.key", ca_key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        self.ca_file.write_bytes(ca.public_bytes(pem))  # (public: the file the nodes get)
        _write_private(self.broker_keystore, key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
            + cert.public_bytes(pem) + ca.public_bytes(pem))

    def client_env(self, user: str, bootstrap: str, ca_file: str | None = None) -> dict[str, str]:
        """The TRAINMON_KAFKA_* settings of a client logging in as ``user``; ``ca_file``:
        where the CA file is on the client's machine (default: here)."""
        return {
            "TRAINMON_KAFKA_BOOTSTRAP": bootstrap,
            "TRAINMON_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "TRAINMON_KAFKA_SASL_MECHANISM": SCRAM,
            "TRAINMON_KAFKA_SASL_USERNAME": user,
            "TRAINMON_KAFKA_SASL_PASSWORD": self.passwords[user],
            "TRAINMON_KAFKA_SSL_CAFILE": ca_file or str(self.ca_file),
        }

    def scram_arguments(self) -> list[str]:
        """``kafka-storage format`` arguments creating the SCRAM users with the storage."""
        args = []
        for user in USERS:
            args += ["--add-scram", f"{SCRAM}=[name={user},password={self.passwords[user]}]"]
        return args

    def plain_jaas(self) -> str:
        """The brokers' own logins to each other and to the controllers (SASL/PLAIN, on
        loopback): SCRAM's credentials live in the metadata the controllers serve, so
        they cannot secure the way to it."""
        admin = self.passwords["admin"]
        return ("org.apache.kafka.common.security.plain.PlainLoginModule required "
                f'username="admin" password="{admin}" user_admin="{admin}";')
