from __future__ import annotations

from django.urls import path, re_path

from webapp.chat import conversations, views

app_name = "chat"
urlpatterns = [
    path("", views.conversation_list, name="index"),
    path("new", views.conversation_new, name="new"),
    path("<int:conversation_id>/", views.conversation_detail, name="conversation"),
    path("<int:conversation_id>/ask", views.conversation_ask, name="ask"),
    path("<int:conversation_id>/scope", conversations.conversation_scope, name="scope"),
    path("<int:conversation_id>/rename", conversations.conversation_rename, name="rename"),
    path("<int:conversation_id>/delete", conversations.conversation_delete, name="delete"),
    re_path(
        r"^(?P<conversation_id>[0-9]+)/export\.(?P<fmt>md|json)$",
        conversations.conversation_export,
        name="export",
    ),
    path("messages/<int:message_id>/", views.message_detail, name="message"),
    path("messages/<int:message_id>/stream", views.message_stream, name="stream"),
    path("messages/<int:message_id>/stop", views.message_stop, name="stop"),
    path("messages/<int:message_id>/regenerate", views.message_regenerate, name="regenerate"),
    path("messages/<int:message_id>/feedback", views.message_feedback, name="feedback"),
    path("citations/<int:citation_id>/", views.citation_detail, name="citation"),
]
