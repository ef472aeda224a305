// CoreDNS with the plugins of the Corefile Kubernetes' kubeadm installs (errors, health, ready,
// kubernetes, prometheus, forward, cache, loop, reload, loadbalance) plus bind and log, and no others: the
// module's own main (core/plugin/zplugin.go) also compiles in the cloud DNS backends (route53,
// azure, clouddns) with their SDKs, which take most of its build time and which the node never uses.
// This is CoreDNS's documented way to build with a chosen plugin set from outside its tree.
package main

import (
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"

	"github.com/coredns/coredns/coremain"
)

func main() {
	coremain.Run()
}
