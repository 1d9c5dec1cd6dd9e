#!/usr/bin/env bash
# Makes the mesh's mutual TLS material for the pdmesh-mesh-tls Secret: a CA, and one
# certificate and key, signed by it, that every service presents and that carries the one
# name every service checks its peers for (PDMESH_TLS_SERVER_NAME, `pdmesh.mesh` in the
# base). Files: DIR/ca.crt, DIR/tls.crt, DIR/tls.key (DIR/ca.key stays with you: it signs
# new certificates). Then:
#   kubectl -n pdmesh create secret generic pdmesh-mesh-tls \
#     --from-file=DIR/ca.crt --from-file=DIR/tls.crt --from-file=DIR/tls.key
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
openssl req "${ec[@]}" -keyout tls.key -out tls.csr -subj "/CN=$name" 2>/dev/null
printf 'subjectAltName=DNS:%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "$name" > tls.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days "$days" \
    -extfile tls.ext 2>/dev/null
rm -f tls.csr tls.ext ca.srl
echo "$dir: ca.crt tls.crt tls.key (for $name, $days days); ca.key signs more"
