#!/usr/bin/env bash
# Makes the mesh's mutual TLS material: a CA, and for each role (gateway, tokenizer,
# worker, cache) a certificate and key signed by it. Each certificate names its role in
# its subject (OU=<role>: each service lets a peer make only the calls its role is for)
# and carries the one name every service checks its peers for (PDMESH_TLS_SERVER_NAME,
# `pdmesh.mesh` in the base). Files: DIR/ca.crt, DIR/<role>/{ca.crt,tls.crt,tls.key}
# (DIR/ca.key stays with you: it signs new certificates). Then, for each role:
#   kubectl -n pdmesh create secret generic pdmesh-mesh-tls-<role> \
#     --from-file=DIR/<role>/ca.crt --from-file=DIR/<role>/tls.crt --from-file=DIR/<role>/tls.key
# Usage: make-mesh-tls.sh DIR [NAME] [DAYS]
set -euo pipefail
dir=${1:?usage: make-mesh-tls.sh DIR [NAME] [DAYS]}
name=${2:-pdmesh.mesh}
days=${3:-365}
mkdir -p "$dir"
cd "$dir"
umask 077
ec=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
openssl req -x509 "${ec[@]}" -keyout ca.key -out ca.crt -days "$days" -subj "/CN=pdmesh mesh CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
printf 'subjectAltName=DNS:%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "$name" > tls.ext
for role in gateway tokenizer worker cache; do
    mkdir -p "$role"
    openssl req "${ec[@]}" -keyout "$role/tls.key" -out "$role/tls.csr" -subj "/OU=$role/CN=$role.$name" 2>/dev/null
    openssl x509 -req -in "$role/tls.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$role/tls.crt" \
        -days "$days" -extfile tls.ext 2>/dev/null
    cp ca.crt "$role/ca.crt"
    rm -f "$role/tls.csr"
done
rm -f tls.ext ca.srl
echo "$dir: ca.crt and gateway/ tokenizer/ worker/ cache/ (each ca.crt tls.crt tls.key, for $name, $days days); ca.key signs more"
