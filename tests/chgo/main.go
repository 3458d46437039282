// chgo runs SQL through clickhouse-go v2 over HTTP -- the driver and protocol of
// Grafana's ClickHouse data source with protocol "http" -- and prints what it read.
//
// Input (stdin, JSON): {"addr": "127.0.0.1:8123", "user": "...", "password": "...",
// "database": "trainmon", "compression": "none|lz4|zstd|gzip|deflate", "tls": false,
// "ca_file": "", "queries": {"name": "SQL", ...}, "exec": {"name": "SQL", ...}}.
// Output (stdout, JSON): {"name": {"columns": [...], "types": [...], "rows": [[...]]}}
// or {"name": {"error": "...", "code": N}}; "connect" holds an error opening the pool.
// Values: floats as numbers or "nan" / "inf" / "-inf", times as {"us": microseconds
// since the epoch}, decimals as floats, big integers as strings, NULL as null.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/big"
	"os"
	"reflect"
	"time"

	"github.com/ClickHouse/clickhouse-go/v2"
	"github.com/shopspring/decimal"
)

type input struct {
	Addr        string            `json:"addr"`
	User        string            `json:"user"`
	Password    string            `json:"password"`
	Database    string            `json:"database"`
	Compression string            `json:"compression"`
	TLS         bool              `json:"tls"`
	CAFile      string            `json:"ca_file"`
	Queries     map[string]string `json:"queries"`
	Exec        map[string]string `json:"exec"`
}

func canonical(v reflect.Value) any {
	if !v.IsValid() {
		return nil
	}
	switch x := v.Interface().(type) {
	case time.Time:
		return map[string]int64{"us": x.UnixMicro()}
	case decimal.Decimal:
		return x.InexactFloat64()
	case big.Int:
		return x.String()
	case *big.Int:
		if x == nil {
			return nil
		}
		return x.String()
	case []byte:
		return string(x)
	case fmt.Stringer:
		if v.Kind() == reflect.Array { // UUID and the like
			return x.String()
		}
	}
	switch v.Kind() {
	case reflect.Pointer, reflect.Interface:
		if v.IsNil() {
			return nil
		}
		return canonical(v.Elem())
	case reflect.Float32, reflect.Float64:
		f := v.Float()
		switch {
		case math.IsNaN(f):
			return "nan"
		case math.IsInf(f, 1):
			return "inf"
		case math.IsInf(f, -1):
			return "-inf"
		}
		return f
	case reflect.Slice, reflect.Array:
		out := make([]any, v.Len())
		for i := range out {
			out[i] = canonical(v.Index(i))
		}
		return out
	case reflect.Map:
		out := map[string]any{}
		for _, k := range v.MapKeys() {
			out[fmt.Sprint(canonical(k))] = canonical(v.MapIndex(k))
		}
		return out
	}
	return v.Interface()
}

func errorOf(err error) map[string]any {
	out := map[string]any{"error": err.Error()}
	var ex *clickhouse.Exception
	if errors.As(err, &ex) {
		out["code"] = ex.Code
		out["message"] = ex.Message
	}
	return out
}

func run(db *sql.DB, query string) map[string]any {
	rows, err := db.QueryContext(context.Background(), query)
	if err != nil {
		return errorOf(err)
	}
	defer rows.Close()
	types, err := rows.ColumnTypes()
	if err != nil {
		return errorOf(err)
	}
	columns, typeNames := []string{}, []string{}
	for _, t := range types {
		columns = append(columns, t.Name())
		typeNames = append(typeNames, t.DatabaseTypeName())
	}
	result := [][]any{}
	for rows.Next() {
		values := make([]any, len(types))
		for i, t := range types {
			values[i] = reflect.New(t.ScanType()).Interface()
		}
		if err := rows.Scan(values...); err != nil {
			return errorOf(err)
		}
		row := make([]any, len(values))
		for i, value := range values {
			row[i] = canonical(reflect.ValueOf(value).Elem())
		}
		result = append(result, row)
	}
	if err := rows.Err(); err != nil {
		return errorOf(err)
	}
	return map[string]any{"columns": columns, "types": typeNames, "rows": result}
}

func main() {
	var in input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		fmt.Fprintln(os.Stderr, "input:", err)
		os.Exit(2)
	}
	methods := map[string]clickhouse.CompressionMethod{
		"none": clickhouse.CompressionNone, "lz4": clickhouse.CompressionLZ4,
		"zstd": clickhouse.CompressionZSTD, "gzip": clickhouse.CompressionGZIP,
		"deflate": clickhouse.CompressionDeflate, "": clickhouse.CompressionNone,
	}
	options := &clickhouse.Options{
		Protocol: clickhouse.HTTP,
		Addr:     []string{in.Addr},
		Auth:     clickhouse.Auth{Database: in.Database, Username: in.User, Password: in.Password},
		// As Grafana's data source sets them: its query timeout becomes max_execution_time.
		Settings:    clickhouse.Settings{"max_execution_time": 60},
		DialTimeout: 10 * time.Second,
		Compression: &clickhouse.Compression{Method: methods[in.Compression]},
	}
	if in.TLS {
		config := &tls.Config{}
		if in.CAFile != "" {
			pem, err := os.ReadFile(in.CAFile)
			if err != nil {
				fmt.Fprintln(os.Stderr, "ca_file:", err)
				os.Exit(2)
			}
			pool := x509.NewCertPool()
			pool.AppendCertsFromPEM(pem)
			config.RootCAs = pool
		}
		options.TLS = config
	}
	out := map[string]any{}
	db := clickhouse.OpenDB(options)
	defer db.Close()
	if err := db.PingContext(context.Background()); err != nil {
		out["connect"] = errorOf(err)
	} else {
		for name, query := range in.Queries {
			out[name] = run(db, query)
		}
		for name, statement := range in.Exec {
			if _, err := db.ExecContext(context.Background(), statement); err != nil {
				out[name] = errorOf(err)
			} else {
				out[name] = map[string]any{"ok": true}
			}
		}
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "output:", err)
		os.Exit(1)
	}
}
