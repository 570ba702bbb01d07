# The proxies the gateway benchmarks compare, configured once for all of
# them (sourced by scripts/bench-serve, scripts/serve-instructions and
# scripts/serve-profile, so that all of them measure the same
# configurations).

# The request every benchmark sends: a short non-streaming chat completion.
SERVE_BODY='{"model":"chat","messages":[{"role":"user","content":"Say something short."}],"max_tokens":16}'

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_http() { # URL: until it answers at all (60 s)
    for ((i = 0; i < 600; i++)); do
        curl -s -o /dev/null "$1" && return 0
        sleep 0.1
    done
    echo "nothing answers at $1" >&2
    return 1
}

# keel_config PORT ADMIN_PORT METRICS_PORT BACKEND_PORT WORKERS FULL TOKEN_SHA256
# prints keel.toml: API keys, RBAC, one model on the backend, metrics and
# admin listeners; with FULL 1 also the access log, the audit log and
# limits high enough never to refuse (keel), with 0 none of them (keel-min).
keel_config() {
    local port=$1 admin=$2 metrics=$3 bport=$4 workers=$5 full=$6 token_sha=$7
    printf '[server]\nlisten = "127.0.0.1:%s"\naccess_log = %s\nworkers = %s\n' "$port" "$( ((full)) && echo true || echo false)" "$workers"
    printf '[admin]\nlisten = "127.0.0.1:%s"\ntoken_sha256 = "%s"\n' "$admin" "$token_sha"
    printf '[metrics]\nlisten = "127.0.0.1:%s"\ntoken_sha256 = "%s"\n' "$metrics" "$token_sha"
    printf '[auth]\nkeys_file = "keys.json"\n'
    if ((full)); then printf '[audit]\npath = "audit.jsonl"\n'; fi
    printf '[roles.user]\nmodels = ["chat"]\noperations = ["chat"]\n'
    if ((full)); then printf '[limits.default]\nrequests_per_minute = 100000000\ntokens_per_minute = 100000000000\ntokens_per_day = 100000000000\n'; fi
    printf '[[models]]\nname = "chat"\n[[models.deployments]]\nname = "blue"\nurl = "http://127.0.0.1:%s"\nmodel = "test"\n' "$bport"
}

# nginx_config DIR PORT BACKEND_PORT WORKERS ACCESS_LOG prints nginx.conf
# for proxy_pass to the backend over kept-alive connections, unbuffered;
# DIR holds its pid file, error log and temporary files. ACCESS_LOG is
# `off` or a file.
nginx_config() {
    local dir=$1 port=$2 bport=$3 workers=$4 alog=$5
    cat <<NGINX
worker_processes $workers;
pid $dir/nginx.pid;
error_log $dir/error.log;
events { worker_connections 4096; }
http {
    access_log $alog;
    client_body_temp_path $dir; proxy_temp_path $dir;
    fastcgi_temp_path $dir; uwsgi_temp_path $dir; scgi_temp_path $dir;
    upstream backend { server 127.0.0.1:$bport; keepalive 256; }
    server {
        listen 127.0.0.1:$port;
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
NGINX
}

# proxy_setup TARGET DIR PORT BACKEND_PORT TOKEN_SHA256 writes the
# configuration of TARGET (keel, keel-min, hyper or nginx) under DIR for
# one serving thread or process on PORT, and sets PROXY_CMD (the command
# that serves, in the foreground: nginx as one process without a master),
# PROXY_HEALTH (a URL that answers once it serves) and PROXY_AUTH (oha's
# -H arguments: keel's API key). Needs KEEL, BARE and NGINX (paths).
proxy_setup() {
    local t=$1 dir=$2 port=$3 bport=$4 token_sha=$5 full=0 key
    PROXY_AUTH=()
    case $t in
    keel | keel-min)
        [[ $t == keel ]] && full=1
        keel_config "$port" "$(free_port)" "$(free_port)" "$bport" 1 "$full" "$token_sha" >"$dir/keel.toml"
        key=$("$KEEL" --json serve keys create --config "$dir/keel.toml" --name bench --role user |
            python3 -c 'import json,sys; print(json.load(sys.stdin)["secret"])')
        PROXY_AUTH=(-H "authorization: Bearer $key")
        PROXY_CMD=("$KEEL" serve --config "$dir/keel.toml")
        PROXY_HEALTH=http://127.0.0.1:$port/healthz
        ;;
    hyper)
        PROXY_CMD=("$BARE" "127.0.0.1:$port" "http://127.0.0.1:$bport" 1)
        PROXY_HEALTH=http://127.0.0.1:$port/health
        ;;
    nginx)
        { printf 'daemon off;\nmaster_process off;\n'; nginx_config "$dir" "$port" "$bport" 1 off; } >"$dir/nginx.conf"
        PROXY_CMD=("$NGINX" -c "$dir/nginx.conf" -p "$dir")
        PROXY_HEALTH=http://127.0.0.1:$port/health
        ;;
    *)
        echo "proxy_setup: unknown target $t" >&2
        return 64
        ;;
    esac
}
