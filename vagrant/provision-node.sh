#!/bin/bash
# Provision one lab node (run by Vagrant as root inside the guest): provision-node.sh INDEX NODES NET_PREFIX.
# Offline: everything comes from the box (Debian packages) and the read-only lab share in /lab
# (vagrant/lab.sh fills it: bin/ the kube binaries, pki/ the certificates and kubeconfigs).
#   every node: routes to the other nodes' pod CIDRs, CNI bridge config for 10.244.INDEX.0/24, containerd with
#               the pause image imported, kubelet (container runtime: containerd over CRI)
#   node 1:     etcd (Debian's etcd-server, 127.0.0.1:2379), kube-apiserver (:6443), kube-controller-manager,
#               kube-scheduler, as systemd units. Under TCG on a busy host the API server answers in seconds and
#               kubelets' status updates time out now and then: the controller manager waits 2 minutes (not 40 s)
#               before it calls a silent node NotReady.
set -euo pipefail
I=$1 N=$2 NET=$3
NODE_IP=$NET.$((10 + I))
API_IP=$NET.11
SERVICE_CIDR=10.96.0.0/12
API_READY_TIMEOUT=1500
log() { echo "provision node$I: $(date +%T) $*"; }
# service NAME AFTER COMMAND...: a long-running systemd unit for one lab daemon, restarted when it exits.
service() {
    local name=$1 after=$2; shift 2
    cat >"/etc/systemd/system/$name.service" <<EOT
[Unit]
Description=$name (pyproxy lab)
After=$after
Wants=$after
[Service]
ExecStart=$*
Restart=always
RestartSec=5
[Install]
WantedBy=multi-user.target
EOT
}

if ! command -v containerd >/dev/null; then
    # A box that is not the local one (VirtualBox users): install what the local box carries.
    log "installing Debian packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containerd runc \
        containernetworking-plugins conntrack iptables nftables ipvsadm ipset etcd-server kubernetes-client \
        socat python3 python3-venv busybox-static
    systemctl disable --now etcd.service || true
fi
[ -d /lab/bin ] || { log "the lab share /lab is not mounted"; exit 1; }

# ---- network: pod CIDR routes over the private network, forwarding, bridge netfilter
modprobe br_netfilter
modprobe overlay
sysctl -q -w net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1
IFACE=$(ip -o -4 addr show | awk -v ip="$NODE_IP" '$4 ~ "^"ip"/" {print $2}')
[ -n "$IFACE" ] || { log "no interface has $NODE_IP"; exit 1; }
ROUTES=""
for j in $(seq 1 "$N"); do
    [ "$j" = "$I" ] && continue
    ROUTES="$ROUTES
ExecStart=/sbin/ip route replace 10.244.$j.0/24 via $NET.$((10 + j)) dev $IFACE"
done
cat >/etc/systemd/system/pyproxy-lab-routes.service <<EOT
[Unit]
Description=pyproxy lab: routes to the other nodes' pod CIDRs
After=network-online.target
Wants=network-online.target
[Service]
Type=oneshot
RemainAfterExit=yes$ROUTES
[Install]
WantedBy=multi-user.target
EOT
systemctl daemon-reload
systemctl enable pyproxy-lab-routes.service
systemctl restart pyproxy-lab-routes.service

mkdir -p /etc/cni/net.d
cat >/etc/cni/net.d/10-pyproxy-lab.conflist <<EOT
{
  "cniVersion": "0.4.0",
  "name": "pyproxy-lab",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.$I.0/24"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
EOT

# ---- binaries and certificates
install -m 0755 /lab/bin/kubelet /usr/local/bin/kubelet
mkdir -p /etc/kubernetes/pki
cp /lab/pki/ca.crt /etc/kubernetes/pki/
cp "/lab/pki/node$I.kubeconfig" /etc/kubernetes/kubelet.kubeconfig
chmod 600 /etc/kubernetes/kubelet.kubeconfig

if [ "$I" = 1 ]; then
    log "control plane"
    for b in kube-apiserver kube-controller-manager kube-scheduler; do install -m 0755 "/lab/bin/$b" /usr/local/bin/; done
    cp /lab/pki/apiserver.crt /lab/pki/apiserver.key /lab/pki/apiserver-kubelet-client.crt \
       /lab/pki/apiserver-kubelet-client.key /lab/pki/sa.key /lab/pki/sa.pub /lab/pki/ca.key /etc/kubernetes/pki/
    cp /lab/pki/controller-manager.kubeconfig /lab/pki/scheduler.kubeconfig /lab/pki/admin.kubeconfig /etc/kubernetes/
    chmod 600 /etc/kubernetes/pki/*.key /etc/kubernetes/*.kubeconfig
    mkdir -p /root/.kube && cp /lab/pki/admin.kubeconfig /root/.kube/config
    systemctl enable --now etcd.service
    P=/etc/kubernetes/pki
    service kube-apiserver etcd.service /usr/local/bin/kube-apiserver --advertise-address=$NODE_IP --bind-address=0.0.0.0 --secure-port=6443 \
        --etcd-servers=http://127.0.0.1:2379 --allow-privileged=true --authorization-mode=Node,RBAC \
        --client-ca-file=$P/ca.crt --tls-cert-file=$P/apiserver.crt --tls-private-key-file=$P/apiserver.key \
        --kubelet-client-certificate=$P/apiserver-kubelet-client.crt --kubelet-client-key=$P/apiserver-kubelet-client.key \
        --kubelet-preferred-address-types=InternalIP \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local --service-account-key-file=$P/sa.pub \
        --service-account-signing-key-file=$P/sa.key --service-cluster-ip-range=$SERVICE_CIDR \
        --service-node-port-range=30000-32767 --enable-admission-plugins=NodeRestriction
    service kube-controller-manager kube-apiserver.service /usr/local/bin/kube-controller-manager --kubeconfig=/etc/kubernetes/controller-manager.kubeconfig \
        --authentication-kubeconfig=/etc/kubernetes/controller-manager.kubeconfig \
        --authorization-kubeconfig=/etc/kubernetes/controller-manager.kubeconfig \
        --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
        --service-account-private-key-file=$P/sa.key --root-ca-file=$P/ca.crt \
        --cluster-signing-cert-file=$P/ca.crt --cluster-signing-key-file=$P/ca.key \
        --service-cluster-ip-range=$SERVICE_CIDR --allocate-node-cidrs=false \
        --node-monitor-grace-period=2m
    service kube-scheduler kube-apiserver.service /usr/local/bin/kube-scheduler --kubeconfig=/etc/kubernetes/scheduler.kubeconfig \
        --authentication-kubeconfig=/etc/kubernetes/scheduler.kubeconfig \
        --authorization-kubeconfig=/etc/kubernetes/scheduler.kubeconfig \
        --bind-address=127.0.0.1 --leader-elect=false
    systemctl daemon-reload
    # The API server first, alone: under TCG on a busy host, starting it beside the controller manager, the
    # scheduler and the kubelet starved it until its initial Service IP check timed out, which is fatal
    # ("Unable to perform initial IP allocation check"), and it restarted in a loop (seen here).
    systemctl enable --now kube-apiserver.service
    log "waiting for the API server's /readyz (up to ${API_READY_TIMEOUT}s)"
    deadline=$(( $(date +%s) + API_READY_TIMEOUT ))
    until kubectl --request-timeout=20s get --raw /readyz >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$deadline" ] || { log "the API server is not ready after ${API_READY_TIMEOUT}s"; exit 1; }
        sleep 5
    done
    log "API server ready"
    systemctl enable --now kube-controller-manager.service kube-scheduler.service
fi

# ---- containerd and kubelet
systemctl restart containerd
for _ in $(seq 60); do ctr version >/dev/null 2>&1 && break; sleep 1; done
ctr -n k8s.io images import /var/lib/pyproxy-lab/pause.tar >/dev/null
# Pod images from the share (the lab's echo image) are imported by a unit in the background: under TCG a 60 MB
# image takes minutes, and a node is Ready without it (pods that need it wait: imagePullPolicy Never retries).
cat >/usr/local/sbin/pyproxy-lab-images <<'EOT'
#!/bin/bash
set -e
for img in /lab/images/*.tar; do
    [ -e "$img" ] || continue
    base=${img%.tar}.base-name
    args=()
    [ -s "$base" ] && args=(--base-name "$(cat "$base")")
    ctr -n k8s.io images import "${args[@]}" "$img"
done
EOT
chmod 755 /usr/local/sbin/pyproxy-lab-images
cat >/etc/systemd/system/pyproxy-lab-images.service <<EOT
[Unit]
Description=pyproxy lab: import the pod images from /lab/images into containerd
After=containerd.service
Requires=containerd.service
[Service]
Type=oneshot
ExecStart=/usr/local/sbin/pyproxy-lab-images
EOT
CGDRIVER=cgroupfs
cat >/etc/kubernetes/kubelet-config.yaml <<EOT
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: /etc/kubernetes/pki/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: $CGDRIVER
clusterDomain: cluster.local
failSwapOn: false
resolvConf: /etc/resolv.conf
serializeImagePulls: false
EOT
service kubelet containerd.service /usr/local/bin/kubelet --config=/etc/kubernetes/kubelet-config.yaml \
    --kubeconfig=/etc/kubernetes/kubelet.kubeconfig --container-runtime=remote \
    --container-runtime-endpoint=unix:///run/containerd/containerd.sock --runtime-request-timeout=10m \
    --node-ip=$NODE_IP --hostname-override=node$I --v=1
systemctl daemon-reload
systemctl enable --now kubelet.service
systemctl start --no-block pyproxy-lab-images.service
log "done: $(stat -fc %T /sys/fs/cgroup) at /sys/fs/cgroup; kubelet $(/usr/local/bin/kubelet --version)"
