#!/bin/sh
# Entry point of the Debian-based nginx image (docker/base-images.sh): what the official nginx
# image's 20-envsubst-on-templates.sh does, then exec the command.
#
# Every $NGINX_ENVSUBST_TEMPLATE_DIR/**/*.template (default /etc/nginx/templates) is rendered
# to $NGINX_ENVSUBST_OUTPUT_DIR (default /etc/nginx/conf.d) under the same relative path without
# the suffix. Only the variables that are set and whose names match $NGINX_ENVSUBST_FILTER (an
# awk regex, default: any) are replaced: nginx's own $variables stay as they are.
set -eu

template_dir=${NGINX_ENVSUBST_TEMPLATE_DIR:-/etc/nginx/templates}
output_dir=${NGINX_ENVSUBST_OUTPUT_DIR:-/etc/nginx/conf.d}
suffix=${NGINX_ENVSUBST_TEMPLATE_SUFFIX:-.template}
filter=${NGINX_ENVSUBST_FILTER:-}

if [ "${1:-}" = nginx ] && [ -d "$template_dir" ]; then
    defined=$(printf '${%s} ' $(awk "END { for (name in ENVIRON) {
        print (name ~ /${filter}/) ? name : \"\" } }" </dev/null))
    find "$template_dir" -follow -type f -name "*$suffix" -print | while read -r template; do
        relative=${template#"$template_dir/"}
        output="$output_dir/${relative%"$suffix"}"
        mkdir -p "$(dirname "$output")"
        echo "nginx-entrypoint: $template -> $output" >&2
        envsubst "$defined" <"$template" >"$output"
    done
fi
exec "$@"
