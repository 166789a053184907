#!/usr/bin/env bash
# Puts oMLX Desktop in the desktop's application menu for this user (freedesktop menus: GNOME,
# KDE, Xfce ...), running the repo's own install:
#
#   packaging/install-desktop-entry.sh               # Exec = <repo>/.venv/bin/omlx-desktop
#   packaging/install-desktop-entry.sh --exec PATH   # another launcher (e.g. the PyInstaller build)
#   packaging/install-desktop-entry.sh --uninstall
#
# Installs into ${XDG_DATA_HOME:-~/.local/share}: applications/omlx-desktop.desktop,
# icons/hicolor/256x256/apps/omlx-desktop.png and icons/hicolor/scalable/apps/omlx-desktop.svg.
# Running it again overwrites the same files (idempotent); --uninstall removes exactly them.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
data_home=${XDG_DATA_HOME:-$HOME/.local/share}
apps_dir=$data_home/applications
icons_dir=$data_home/icons/hicolor
desktop_file=$apps_dir/omlx-desktop.desktop
png_icon=$icons_dir/256x256/apps/omlx-desktop.png
svg_icon=$icons_dir/scalable/apps/omlx-desktop.svg

usage() {
    sed -n '2,11s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

refresh_caches() {
    # Menus and icon themes notice new files by themselves on most desktops; an icon cache, if
    # the user has one, is refreshed so that it does not hide the new icon. (No
    # update-desktop-database: the entry declares no MimeType, so there is no cache to update.)
    # Failures here are not the install's failures.
    if command -v gtk-update-icon-cache >/dev/null 2>&1 && [ -f "$icons_dir/index.theme" ]; then
        gtk-update-icon-cache -q -t "$icons_dir" 2>/dev/null || true
    fi
}

action=install
exec_path=$repo/.venv/bin/omlx-desktop
while [ $# -gt 0 ]; do
    case $1 in
        --uninstall) action=uninstall ;;
        --exec) [ $# -ge 2 ] || { echo "--exec needs a path" >&2; exit 2; }; exec_path=$2; shift ;;
        --exec=*) exec_path=${1#--exec=} ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

if [ "$action" = uninstall ]; then
    rm -f "$desktop_file" "$png_icon" "$svg_icon"
    refresh_caches
    echo "removed oMLX Desktop's menu entry and icons from $data_home"
    exit 0
fi

case $exec_path in /*) ;; *) exec_path=$(pwd)/$exec_path ;; esac
if [ ! -x "$exec_path" ]; then
    echo "error: $exec_path is not an executable file." >&2
    echo "Install the app first (README: python3.11 -m venv .venv && .venv/bin/pip install -e '.[dev]')," >&2
    echo "or name another launcher with --exec PATH." >&2
    exit 1
fi
for f in "$here/omlx-desktop.desktop" "$repo/resources/omlx-desktop.png" "$repo/resources/omlx-desktop.svg"; do
    [ -f "$f" ] || { echo "error: missing $f" >&2; exit 1; }
done

# Desktop Entry Exec quoting: a path with spaces or reserved characters goes in double quotes,
# with \ " ` $ escaped by a backslash.
quoted=$exec_path
if [[ $exec_path =~ [[:space:]\"\'\\\`\$\<\>\~\|\&\;\*\?\#\(\)] ]]; then
    quoted=${exec_path//\\/\\\\}
    quoted=${quoted//\"/\\\"}
    quoted=${quoted//\`/\\\`}
    quoted=${quoted//\$/\\\$}
    quoted="\"$quoted\""
fi
# In the .desktop file's string values a backslash is itself escaped once more.
quoted_value=${quoted//\\/\\\\}
tryexec_value=${exec_path//\\/\\\\}

mkdir -p "$apps_dir" "$(dirname "$png_icon")" "$(dirname "$svg_icon")"
tmp=$(mktemp "$apps_dir/.omlx-desktop.XXXXXX")
trap 'rm -f "$tmp"' EXIT
while IFS= read -r line || [ -n "$line" ]; do
    case $line in
        Exec=*) args=${line#Exec=}; args=${args#* }; [ "$args" = "${line#Exec=}" ] && args=""
                printf 'Exec=%s%s\n' "$quoted_value" "${args:+ $args}" ;;
        TryExec=*) printf 'TryExec=%s\n' "$tryexec_value" ;;
        *) printf '%s\n' "$line" ;;
    esac
done <"$here/omlx-desktop.desktop" >"$tmp"
chmod 644 "$tmp"
mv -f "$tmp" "$desktop_file"
trap - EXIT
install -m 644 "$repo/resources/omlx-desktop.png" "$png_icon"
install -m 644 "$repo/resources/omlx-desktop.svg" "$svg_icon"
refresh_caches

if command -v desktop-file-validate >/dev/null 2>&1; then
    desktop-file-validate "$desktop_file"
fi
echo "installed $desktop_file (Exec: $exec_path)"
echo "icons: $png_icon, $svg_icon"
