// Command probe is the real-node test bed's smoke-test workload, a static binary in a
// one-file image (test image, never shipped):
//
//	probe serve [ADDR]     HTTP on ADDR (default :8080): "/" answers JSON naming the pod and
//	                       its node (env POD_NAME, NODE_NAME), "/healthz" answers "ok"
//	probe get URL          GET URL, print the body; exit 1 unless the status is 2xx
//	probe resolve NAME     print NAME's addresses (cluster DNS); exit 1 if it does not resolve
//	probe kube PATH        GET PATH from the API server as the pod's service account, the way
//	                       in-cluster clients do (KUBERNETES_SERVICE_HOST/PORT, its token and
//	                       CA); print the body; exit 1 unless the status is 2xx
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"
)

func serve(addr string) error {
	host, _ := os.Hostname()
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]string{
			"hostname": host,
			"pod":      os.Getenv("POD_NAME"),
			"node":     os.Getenv("NODE_NAME"),
			"client":   r.RemoteAddr,
		})
	})
	fmt.Printf("probe serving on %s as %s\n", addr, host)
	return http.ListenAndServe(addr, mux)
}

func get(url string) error {
	return fetch(&http.Client{Timeout: 5 * time.Second}, url, "")
}

const serviceAccount = "/var/run/secrets/kubernetes.io/serviceaccount"

func kube(path string) error {
	token, err := os.ReadFile(serviceAccount + "/token")
	if err != nil {
		return err
	}
	ca, err := os.ReadFile(serviceAccount + "/ca.crt")
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return fmt.Errorf("no certificate in %s/ca.crt", serviceAccount)
	}
	client := &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}},
	}
	host := net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"))
	return fetch(client, "https://"+host+path, string(token))
}

func fetch(client *http.Client, url, token string) error {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	os.Stdout.Write(body)
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("GET %s: status %d", url, resp.StatusCode)
	}
	return nil
}

func resolve(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupHost(ctx, name)
	if err != nil {
		return err
	}
	for _, a := range addrs {
		fmt.Println(a)
	}
	return nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: probe serve [ADDR] | get URL | resolve NAME | kube PATH")
		os.Exit(2)
	}
	var err error
	switch cmd, args := os.Args[1], os.Args[2:]; {
	case cmd == "serve" && len(args) <= 1:
		addr := ":8080"
		if len(args) == 1 {
			addr = args[0]
		}
		err = serve(addr)
	case cmd == "get" && len(args) == 1:
		err = get(args[0])
	case cmd == "resolve" && len(args) == 1:
		err = resolve(args[0])
	case cmd == "kube" && len(args) == 1:
		err = kube(args[0])
	default:
		fmt.Fprintf(os.Stderr, "probe: bad command %q\n", os.Args[1:])
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "probe:", err)
		os.Exit(1)
	}
}
