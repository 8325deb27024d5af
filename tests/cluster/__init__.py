"""The cluster tier: real kubelets, containerd, CNI, kube-proxy, CoreDNS and KubeRay on this
host (tests/testbed, real-node mode). A package, so its `cluster` fixture ends with the tier."""
