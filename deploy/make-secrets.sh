#!/usr/bin/env bash
# Make the secrets compose.secure.yaml mounts (Compose file secrets, at /run/secrets/ in the
# containers): the gRPC shared secret and a self-signed CA with one server certificate for
# the whole stack.
#
#   deploy/make-secrets.sh [DIR]      # default DIR: deploy/secrets; keeps files that exist
#   FORCE=1 deploy/make-secrets.sh    # new secret, CA and certificate
#
# DIR/auth-token   the shared secret (--auth-token-file): gateway -> verifier -> drafters, the
#                  admin RPCs, `specd drafters`, and the proof of trusted drafters
# DIR/ca.crt       the CA that signed tls.crt (--tls-ca; give it to clients of the gateway)
# DIR/tls.crt      server certificate of every service (--tls-cert, the gateway's --ssl-certfile)
# DIR/tls.key      its key (--tls-key, --ssl-keyfile)
# DIR/ca.key       the CA's key: stays here, never mounted; needed only to sign more certificates
#
# The certificate names every compose service, `specd-drafter` (the name the verifier checks
# on drafter certificates, --tls-server-name: swapped-in drafters have container names no
# certificate can list ahead), localhost and 127.0.0.1 (healthchecks, published ports).
# Extra names: NAMES="gateway.example.com" (space-separated; DNS names or IPv4 addresses).
#
# The files are mode 0644 in a 0700 directory: Compose bind-mounts them as they are, and the
# services run as uid 65534, which must read them; on the host only root passes the directory.
set -euo pipefail

DIR=${1:-$(dirname "$0")/secrets}
DAYS=${DAYS:-825}
NAMES="gateway verifier drafter-dm drafter-ngram specd-drafter localhost 127.0.0.1 ${NAMES:-}"

mkdir -p "$DIR"
chmod 700 "$DIR"
printf '*\n' > "$DIR/.gitignore"  # never committed
cd "$DIR"

if [[ -n "${FORCE:-}" || ! -s auth-token ]]; then
  (umask 022; openssl rand -hex 32 > auth-token)  # 256 bits
  echo "wrote $DIR/auth-token"
fi

if [[ -n "${FORCE:-}" || ! -s tls.crt || ! -s tls.key || ! -s ca.crt ]]; then
  san=""
  for n in $NAMES; do
    if [[ $n =~ ^[0-9.]+$ ]]; then san+="IP:$n,"; else san+="DNS:$n,"; fi
  done
  (umask 077; openssl ecparam -name prime256v1 -genkey -noout -out ca.key)
  openssl req -x509 -new -key ca.key -sha256 -days "$DAYS" -subj "/CN=specd stack CA" -out ca.crt \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  (umask 022; openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8 -topk8 -nocrypt -out tls.key)
  openssl req -new -key tls.key -subj "/CN=specd" -out tls.csr
  printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n' \
    "${san%,}" > tls.ext
  openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days "$DAYS" \
    -extfile tls.ext -out tls.crt 2>/dev/null
  rm -f tls.csr tls.ext ca.srl
  echo "wrote $DIR/ca.crt, tls.crt, tls.key for: $NAMES"
fi
chmod 644 auth-token ca.crt tls.crt tls.key
