#!/bin/bash
# The lab's certificates and kubeconfigs, made with openssl on the host: pki.sh DIR NODES NET_PREFIX.
# A small CA; the API server's serving certificate (node 1's address, the kubernetes Service's ClusterIP,
# 127.0.0.1, the kubernetes.default names); client certificates for the admin (system:masters), the API server
# towards kubelets (system:masters: kubelets authorise it through webhook), the controller manager, the
# scheduler and every node's kubelet (system:node:nodeI in system:nodes, as the Node authorizer wants);
# the service-account key pair. Kept when the CA already exists and covers NODES nodes.
set -euo pipefail
D=$1 N=$2 NET=$3
API=https://$NET.11:6443
mkdir -p "$D"
cd "$D"
if [ -s ca.crt ] && [ -s "node$N.kubeconfig" ] && [ "$(cat net 2>/dev/null)" = "$NET" ]; then exit 0; fi
umask 077
openssl_req() { openssl req -new -nodes -newkey rsa:2048 -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null; }
sign() {  # name [extensions file]
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -out "$1.crt" \
        ${2:+-extfile "$2"} 2>/dev/null
    rm -f "$1.csr"
}
[ -s ca.crt ] || openssl req -x509 -new -nodes -newkey rsa:2048 -keyout ca.key -out ca.crt -days 3650 \
    -subj "/CN=pyproxy-lab-ca" 2>/dev/null
cat >apiserver.ext <<EOT
basicConstraints = CA:FALSE
keyUsage = digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:$NET.11, IP:10.96.0.1, IP:127.0.0.1, DNS:kubernetes, DNS:kubernetes.default, DNS:kubernetes.default.svc, DNS:kubernetes.default.svc.cluster.local, DNS:node1
EOT
printf 'basicConstraints = CA:FALSE\nkeyUsage = digitalSignature, keyEncipherment\nextendedKeyUsage = clientAuth\n' >client.ext
openssl_req apiserver "/CN=kube-apiserver" && sign apiserver apiserver.ext
openssl_req apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" && sign apiserver-kubelet-client client.ext
openssl genrsa -out sa.key 2048 2>/dev/null && openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null

kubeconfig() {  # name user
    cat >"$1.kubeconfig" <<EOT
apiVersion: v1
kind: Config
clusters:
- name: pyproxy-lab
  cluster: {server: "$API", certificate-authority-data: $(base64 -w0 ca.crt)}
users:
- name: $2
  user: {client-certificate-data: $(base64 -w0 "$1.crt"), client-key-data: $(base64 -w0 "$1.key")}
contexts:
- name: pyproxy-lab
  context: {cluster: pyproxy-lab, user: $2}
current-context: pyproxy-lab
EOT
}
openssl_req admin "/O=system:masters/CN=admin" && sign admin client.ext && kubeconfig admin admin
openssl_req controller-manager "/CN=system:kube-controller-manager" && sign controller-manager client.ext &&
    kubeconfig controller-manager system:kube-controller-manager
openssl_req scheduler "/CN=system:kube-scheduler" && sign scheduler client.ext && kubeconfig scheduler system:kube-scheduler
for i in $(seq 1 "$N"); do
    openssl_req "node$i" "/O=system:nodes/CN=system:node:node$i" && sign "node$i" client.ext &&
        kubeconfig "node$i" "system:node:node$i"
done
echo "$NET" >net
# The share is read by qemu (as root here) and copied by provisioning; the directory stays private on the host.
chmod 644 ./*
